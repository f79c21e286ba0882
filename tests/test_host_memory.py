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

def faults(nbytes, reps=4):
    for _ in range(3):  # the heap grows to its high-water mark first; the steady state is what a long run sees
        x = torch.empty(nbytes, dtype=torch.uint8); x.fill_(1); del x
    r0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(reps):
        x = torch.empty(nbytes, dtype=torch.uint8); x.fill_(1); del x
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r0) / reps

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
    # page in; kept in the heap, none
    assert before > 2500, f"the default allocator should map a 20 MB block afresh ({before:.0f} faults)"
    assert after < 100, f"{after:.0f} faults per reused 20 MB block"
