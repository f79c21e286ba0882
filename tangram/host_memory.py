"""Host allocator settings: the CPU evaluation's large, short-lived tensors, and the simulator's large, sparse arrays.

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
import mmap
import sys

import numpy as np

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


# numpy advises the kernel to back every array of 4 MiB or more with 2 MiB transparent huge pages (where THP is in
# "madvise" mode, as on this machine); below this size it does not, so neither do we
_SPARSE_MIN_BYTES = 4 << 20


def sparse_zeros(shape, dtype) -> np.ndarray:
    """A zero-filled array whose memory is taken 4 KiB at a time, as it is first written, for large arrays written
    sparsely (the simulator's block table, where a few hundred thousand named page ids are spread over a
    ~300 MB rectangle of rows x tables x columns, and the prefix cache's per-page arrays).

    ``np.zeros`` / ``np.empty`` of such an array ask for transparent huge pages (numpy's ``madvise(MADV_HUGEPAGE)``
    on allocations of 4 MiB and more), so each first write into a 2 MiB region zeroes (and may first compact) all of
    it: a Mooncake replay's last block-table grow took 477 ms (14 ms with this), its peak RSS 560 MB (350 MB with
    this; reports/traces/README.md). An anonymous private mapping advised
    ``MADV_NOHUGEPAGE`` is zero-filled by the kernel and faulted in 4 KiB pages; it is unmapped when the array (its
    buffer's last holder) is freed. Elsewhere (no ``MADV_NOHUGEPAGE``: not Linux), or below 4 MiB, ``np.zeros``."""
    dtype = np.dtype(dtype)
    n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    advise = getattr(mmap, "MADV_NOHUGEPAGE", None)
    if n < _SPARSE_MIN_BYTES or advise is None:
        return np.zeros(shape, dtype=dtype)
    buf = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        buf.madvise(advise)
    except OSError:  # a kernel without THP refuses the advice: 4 KiB pages anyway
        pass
    return np.frombuffer(buf, dtype=dtype).reshape(shape)
