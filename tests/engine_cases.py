"""A tiny Llama-shaped model for the engine's CPU tests (float64 reference kernels), shared by the test modules that
serve traces through the executor."""
from __future__ import annotations

import dataclasses

import pytest

from tangram.config import get_model
from tangram.engine.weights import build_model, random_state_dict


def tiny_cfg():
    base = get_model("llama-3.1-8b")
    return dataclasses.replace(base, name="tiny", num_layers=2, hidden=64, intermediate=96, vocab=211, head_dim=16,
                               num_q_heads=8, num_kv_heads=4, rope_scaling=None, max_context=4096)


def tiny_model(seed: int):
    cfg = tiny_cfg()
    return cfg, build_model(cfg, random_state_dict(cfg, seed=seed))


@pytest.fixture(autouse=True)
def reference_kernels():
    """Every test of a module that imports this fixture runs on the float64 reference kernels."""
    from tangram.kernels import cpu_reference
    with cpu_reference(True):
        yield
