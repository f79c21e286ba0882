"""Tangram: serving, simulation and tuning for non-uniform (per-head) KV cache compression."""

__version__ = "0.1.0"
