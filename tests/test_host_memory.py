"""tangram.host_memory: freed large blocks (torch's CPU tensors, as the evaluation allocates them) are reused instead of mapped afresh (checked in a child process, since
the setting is process-wide)."""
from __future__ import annotations

import subprocess
import sys

import pytest

_CHILD = r"""
import resource
import torch
from tangram.host_memory import retain_freed_memory

def faults(nbytes, reps=5):
    for _ in range(3):  # the heap grows to its high-water mark first; the steady state is what a long run sees
        x = torch.empty(nbytes, dtype=torch.uint8); x.fill_(1); del x
    per = []
    for _ in range(reps):
        r0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        x = torch.empty(nbytes, dtype=torch.uint8); x.fill_(1); del x
        per.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r0)
    return sorted(per)[reps // 2]  # the median block: now and then one lands on fresh heap pages (below)

before = faults(20 << 20)
ok = retain_freed_memory()
after = faults(20 << 20)
print(ok, before, after)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_blocks_are_reused_without_new_page_faults():
    out = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, check=True).stdout.split()
    ok, before, after = out[0] == "True", float(out[1]), float(out[2])
    if not ok:
        pytest.skip("this libc does not take mallopt's settings")
    # 20 MB (about a batch of cache rows of one layer) is 5,120 pages: mapped afresh, every block faults each
    # page in; kept in the heap, none. Per block, not on average: about one child in six had one of its blocks of
    # the steady state fault all 5,120 pages in (the heap's top moved past it), so a mean of 4 read 1,280 (the
    # same with this module as of be6e3f8: not the settings failing, the measurement)
    assert before > 2500, f"the default allocator should map a 20 MB block afresh ({before:.0f} faults)"
    assert after < 100, f"{after:.0f} faults per reused 20 MB block"


def _resident_bytes() -> int:
    import os

    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.parametrize("shape,dtype", [((3, 5, 7), "int32"), (((64 << 20) // 8,), "int64"), ((40, 64, 4096), "int32")])
def test_sparse_zeros_is_a_zeroed_writable_array_of_the_shape(shape, dtype):
    import numpy as np

    from tangram.host_memory import sparse_zeros

    a = sparse_zeros(shape, dtype)
    assert a.shape == shape and a.dtype == np.dtype(dtype) and a.flags.writeable and a.flags.c_contiguous
    assert not a.any()
    flat = a.reshape(-1)
    idx = np.random.default_rng(0).choice(flat.size, 100, replace=False)
    flat[idx] = 7  # a view of the same memory: written through
    assert int(a.sum()) == 700 and (a.reshape(-1)[idx] == 7).all()
    b = a[1:]  # a view keeps the mapping alive after the array itself is gone
    del a, flat
    assert int(b.sum()) >= 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/statm, MADV_NOHUGEPAGE")
def test_sparse_zeros_takes_memory_a_small_page_per_first_write():
    """Writes 2 MiB apart into 256 MiB: 128 small pages (0.5 MiB), not 128 huge ones (256 MiB) as numpy's own
    arrays of this size take where transparent huge pages are on for advised regions."""
    import numpy as np

    from tangram.host_memory import sparse_zeros

    a = sparse_zeros((256 << 20) // 4, np.int32)
    r0 = _resident_bytes()
    a[:: (2 << 20) // 4] = 1
    grown = _resident_bytes() - r0
    assert int(a.sum()) == 128
    assert grown < 16 << 20, f"{grown >> 20} MiB resident for 128 writes"
