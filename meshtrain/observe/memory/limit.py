"""How much memory a rank may use, for the run's breakdown.csv and report.

On a GPU it is the rank's own device's memory. On a CPU it is the host's, and the ranks on one
node share it: the lowest memory limit of the process's cgroups (a container's, a Slurm job's,
systemd's) when one is set, else the machine's physical memory. The ranks a launcher starts on a
node sit in the same cgroup, so that limit holds for all of them together, not for each.
"""

from __future__ import annotations

import functools
import os
import resource
from pathlib import Path

import torch

PROC_CGROUP = Path("/proc/self/cgroup")
CGROUP_ROOT = Path("/sys/fs/cgroup")


def physical_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _read_limit(path: Path) -> int | None:
    """A cgroup limit file's value in bytes; None when absent, unreadable or unlimited."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if not text.isdigit():  # v2 writes "max" for none
        return None
    return int(text)


def cgroup_memory_limit(proc_cgroup: Path | None = None,
                        root: Path | None = None) -> tuple[int, str] | None:
    """(the lowest memory limit set on this process's cgroup or one above it, the file that
    sets it), or None when no cgroup limits memory. cgroup v2 (``memory.max``, a ``0::/path``
    line) and v1 (``memory.limit_in_bytes`` under ``memory/``, a ``N:memory:/path`` line).
    ``proc_cgroup``, ``root``: :data:`PROC_CGROUP`, :data:`CGROUP_ROOT` by default."""
    proc_cgroup, root = proc_cgroup or PROC_CGROUP, root or CGROUP_ROOT
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    found: list[tuple[int, str]] = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            base, name = root, "memory.max"
        elif "memory" in controllers.split(","):
            base, name = root / "memory", "memory.limit_in_bytes"
        else:
            continue
        folder = base / path.lstrip("/")
        while True:  # the limit of every cgroup on the way up applies
            if (limit := _read_limit(folder / name)) is not None:
                found.append((limit, str(folder / name)))
            if folder == base or base not in folder.parents:
                break
            folder = folder.parent
    # v1 writes a huge number (2**63 rounded to pages) for "no limit"
    found = [(limit, where) for limit, where in found if limit < 2**62]
    return min(found) if found else None


@functools.cache
def host_memory_limit() -> tuple[int, str]:
    """(bytes, where the number comes from) of the memory the processes on this node share."""
    physical = physical_memory()
    cgroup = cgroup_memory_limit()
    if cgroup is not None and cgroup[0] < physical:
        return cgroup[0], f"cgroup limit ({cgroup[1]})"
    return physical, "the machine's physical memory"


def memory_peak_and_limit(device: torch.device) -> tuple[int, int]:
    """(this process's peak memory, its limit) in bytes: the allocator's peak and the GPU's
    memory on CUDA; on CPU the process's peak resident size and :func:`host_memory_limit`,
    which the node's ranks share."""
    if device.type == "cuda":
        return (torch.cuda.max_memory_allocated(device),
                torch.cuda.get_device_properties(device).total_memory)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return peak, host_memory_limit()[0]


def limit_description(device: torch.device) -> dict:
    """What ``mem_limit_bytes`` means, for environment.json: ``memory_limit_scope`` ("device":
    each rank's own GPU; "node": shared by the node's ranks) and ``memory_limit_source``."""
    if device.type == "cuda":
        return {"memory_limit_scope": "device", "memory_limit_source": "the GPU's memory"}
    return {"memory_limit_scope": "node", "memory_limit_source": host_memory_limit()[1]}
