"""PeakRSS measures the peak host memory of a stretch of code, again and again in one process."""

import mmap

from meshtrain.observe.memory.peak_rss import PeakRSS, resident_bytes

MIB = 2**20
PAGE = mmap.PAGESIZE


def touch(n_bytes: int) -> None:
    """Map n_bytes of fresh anonymous memory, touch every page, unmap it: a transient allocation
    whose pages cannot come from an allocator's cache left by earlier tests in this process."""
    block = mmap.mmap(-1, n_bytes)
    for i in range(0, n_bytes, PAGE):
        block[i] = 1
    block.close()


def test_a_transient_allocation_is_seen_and_the_peak_resets():
    with PeakRSS() as big:
        touch(64 * MIB)
    assert 62 * MIB <= big.bytes < 80 * MIB
    with PeakRSS() as small:  # the 64 MiB peak before does not count here
        touch(16 * MIB)
    assert 15 * MIB <= small.bytes < 32 * MIB
    with PeakRSS() as nothing:
        pass
    assert nothing.bytes < 4 * MIB
    assert resident_bytes() > 0


TORCH_TENSOR = """
import torch
from meshtrain.observe.memory.peak_rss import PeakRSS
with PeakRSS() as peak:
    x = torch.ones(64 * 2**20 // 4)  # 64 MiB, above glibc's largest mmap threshold: fresh pages
    del x
print(peak.bytes)
"""


def test_a_torch_tensor_counts():
    """In a fresh process: in this one, earlier tests may leave the 64 MiB in an allocator's
    cache (it measured 0 in CI after the suite's other tests in the same worker)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", TORCH_TENSOR], capture_output=True, text=True,
                         timeout=60, check=True)
    assert 62 * MIB <= int(out.stdout.split()[-1]) < 80 * MIB, out
