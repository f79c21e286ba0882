"""tangram.tuning"""
