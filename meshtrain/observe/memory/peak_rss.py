"""The peak host memory of a stretch of code on Linux (a CPU run's answer to CUDA's
``max_memory_allocated``): what memory estimates are checked against on CPU.

Linux keeps each process's high-water mark of resident memory (``VmHWM`` in
``/proc/self/status``), and writing ``5`` to ``/proc/self/clear_refs`` resets it to the current
resident size, so the peak of a stretch is measurable again and again in one process:

    with PeakRSS() as peak:
        step()
    peak.bytes      # the highest resident size reached inside, above the size at the start

It counts everything the process touches (torch's allocator, Python, libraries), at page
granularity; memory freed to the allocator's cache and reused does not count twice.
"""

from __future__ import annotations

from pathlib import Path

from meshtrain.errors import ConfigError

STATUS = Path("/proc/self/status")
CLEAR_REFS = Path("/proc/self/clear_refs")


def _status_kib(field: str) -> int:
    for line in STATUS.read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise ConfigError(f"/proc/self/status has no {field}: PeakRSS needs Linux")


def resident_bytes() -> int:
    """This process's resident memory now."""
    return _status_kib("VmRSS") * 1024


class PeakRSS:
    """Context manager: ``bytes`` is the peak resident memory inside it above the resident size
    at its start (0 if it never grew)."""

    def __init__(self) -> None:
        self.start = self.peak = self.bytes = 0

    def __enter__(self) -> PeakRSS:
        if not CLEAR_REFS.exists():
            raise ConfigError("PeakRSS needs Linux's /proc/self/clear_refs (to reset the peak)")
        CLEAR_REFS.write_text("5")
        self.start = resident_bytes()
        return self

    def __exit__(self, *exc) -> None:
        self.peak = _status_kib("VmHWM") * 1024
        self.bytes = max(0, self.peak - self.start)
