"""PeakRSS measures the peak host memory of a stretch of code, again and again in one process."""

import torch

from meshtrain.observe.memory.peak_rss import PeakRSS, resident_bytes

MIB = 2**20


def test_a_transient_allocation_is_seen_and_the_peak_resets():
    with PeakRSS() as big:
        x = torch.ones(64 * MIB // 4)  # 64 MiB, touched
        del x
    assert 62 * MIB <= big.bytes < 80 * MIB  # (pages already resident may be reused)
    with PeakRSS() as small:  # the 64 MiB peak before does not count here
        y = torch.ones(16 * MIB // 4)
        del y
    assert 15 * MIB <= small.bytes < 32 * MIB
    with PeakRSS() as nothing:
        pass
    assert nothing.bytes < 4 * MIB
    assert resident_bytes() > 0
