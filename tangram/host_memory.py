"""Host allocator settings for the CPU evaluation's large, short-lived tensors.

The accuracy evaluation (``tangram.profiles.evaluate``'s workers) builds a batch of cache rows per layer (tens of MB each: the shared prefix copied
into every row) and drop it a moment later. glibc serves blocks above its mmap threshold with fresh mappings and
returns them on free, so every such tensor pays one page fault per 4 KB on its first write: on the 2-core AMD VM a
1,024-token task sample took ~2.7 M minor faults, about a quarter of its CPU time in the kernel. Keeping freed
blocks in the heap (a fixed, high mmap threshold and no trimming) reuses the pages already touched. Values and
layouts are unchanged, so results are the same bit for bit; only peak RSS stays at its high-water mark.

Measured with torch's CPU tensors (``posix_memalign``) on glibc 2.36, in the steady state after a few blocks of a
size: 8-24 MB blocks are then reused without a fault (5,120 faults per 20 MB block before), blocks of 48 MB and
more are still faulted in afresh (glibc's aligned allocation does not reuse them); tests/test_host_memory.py.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import sys

# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
# glibc 2.36 takes up to 2 GiB - 1; older ones refuse a threshold above HEAP_MAX_SIZE / 2 (32 MiB on 64-bit)
_FALLBACK_THRESHOLD = 32 << 20


def retain_freed_memory(mmap_threshold: int = 1 << 30, top_pad: int = 256 << 20) -> bool:
    """Serve blocks up to ``mmap_threshold`` bytes (32 MiB where glibc refuses more) from the heap and never trim
    it. Returns whether glibc took the settings (False elsewhere, e.g. macOS or musl: a no-op)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = mallopt(_M_MMAP_THRESHOLD, int(mmap_threshold)) == 1 or mallopt(_M_MMAP_THRESHOLD, _FALLBACK_THRESHOLD) == 1
    ok &= mallopt(_M_TRIM_THRESHOLD, 2**31 - 1) == 1  # an int: the largest a call can pass
    ok &= mallopt(_M_TOP_PAD, int(top_pad)) == 1
    return bool(ok)
