"""The real model: Llama-family decoder, weight loaders and GGUF tokenizer (CPU reference path)."""
from tangram.engine.model import AttnContext, AttnEvent, Session, TorchAttention, Transformer

__all__ = ["AttnContext", "AttnEvent", "Session", "TorchAttention", "Transformer"]
