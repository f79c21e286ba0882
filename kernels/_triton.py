"""Triton import point; tells whether kernels can run on a tensor's device.

On a CPU-only machine Triton still imports; its kernels then run only under
``TRITON_INTERPRET=1`` (tests), otherwise the public functions fall back to the
float64 torch references in :mod:`tangram.kernels.reference`.
"""
from __future__ import annotations

import contextlib
import os

import numpy as np

import torch
import triton
import triton.language as tl


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


_CPU_REFERENCE = False


@contextlib.contextmanager
def cpu_reference(enabled: bool = True):
    """Run CPU tensors through the float64 torch references even under ``TRITON_INTERPRET=1``.

    The interpreter executes a kernel's every program in numpy, which is right for checking a kernel on tiny shapes
    (tests/test_kernels.py) but turns a whole model forward into minutes; tests of the engine's plumbing use this.
    CUDA tensors always run Triton."""
    global _CPU_REFERENCE
    prev, _CPU_REFERENCE = _CPU_REFERENCE, enabled
    try:
        yield
    finally:
        _CPU_REFERENCE = prev


def runs_triton(t: torch.Tensor) -> bool:
    return t.is_cuda or (interpreting() and not _CPU_REFERENCE)


def _fix_interpreter_index() -> None:
    """Triton 3.6's interpreter turns a scalar into a 1-element array; numpy >= 2.4 refuses int() of it,
    which breaks ``range(start, end)`` loops with loaded bounds. Patch ``__index__`` to take the element."""
    from triton.runtime import interpreter as _itp

    orig = _itp._patch_lang_tensor
    if getattr(orig, "_tangram_fixed", False):
        return

    def patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._tangram_fixed = True
    _itp._patch_lang_tensor = patched

    # The interpreter stores bf16 as raw uint16 bits and tl.dot multiplied those bits (error ~1e10 measured):
    # widen bf16 operands to fp32 (exact) before the matmul.
    builder = _itp.InterpreterBuilder
    orig_dot = builder.create_dot

    def _widen(h):
        if h.dtype == tl.bfloat16:
            bits = h.data.astype(np.uint32) << 16
            return _itp.TensorHandle(bits.view(np.float32), tl.float32)
        return h

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return orig_dot(self, _widen(a), _widen(b), d, input_precision, max_num_imprecise_acc)

    builder.create_dot = create_dot


if interpreting():
    _fix_interpreter_index()


__all__ = ["triton", "tl", "interpreting", "runs_triton", "cpu_reference"]


@triton.jit
def attend_block(q, k, v, ok, m_i, l_i, acc, qk_scale, IEEE: tl.constexpr):
    """One key block of a flash-attention loop (online softmax in base 2): scores of ``q`` on ``k`` where ``ok``,
    then the running max ``m_i``, normaliser ``l_i`` and accumulator ``acc`` updated with ``v``. Shared by the
    decode, prefill and batched-compression kernels (inlined by Triton)."""
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = tl.where(ok, s * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc
