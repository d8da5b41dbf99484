"""How a sweep splits the machine: disjoint slots of devices, one trial in each at a time.

On GPUs a slot is a set of device indices (``CUDA_VISIBLE_DEVICES``); on a CPU a set of cores
(the trial's processes are pinned to them by affinity, one thread per rank). A trial's
processes die with the sweep (Linux: the parent-death signal), so a killed sweep leaves none
behind to clash with the trials it runs again."""

from __future__ import annotations

import ctypes
import dataclasses
import os
import signal

from meshtrain.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Slot:
    index: int
    kind: str  # "cpu" or "cuda"
    devices: tuple[int, ...]

    def environ(self) -> dict[str, str]:
        if self.kind == "cuda":
            return {"CUDA_VISIBLE_DEVICES": ",".join(map(str, self.devices))}
        return {"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}

    def describe(self) -> str:
        what = "GPU" if self.kind == "cuda" else "core"
        plural = "s" if len(self.devices) > 1 else ""
        return f"slot {self.index}: {what}{plural} {', '.join(map(str, self.devices))}"


def machine_devices(accelerator: str) -> tuple[str, list[int]]:
    """("cuda", GPU indices) when the job runs on GPUs, else ("cpu", the cores this process may
    use)."""
    if accelerator != "cpu":
        import torch

        if torch.cuda.is_available():
            return "cuda", list(range(torch.cuda.device_count()))
        if accelerator in ("cuda", "gpu"):
            raise ConfigError(f"accelerator={accelerator!r} but no CUDA device is visible")
    return "cpu", sorted(os.sched_getaffinity(0))


def split(kind: str, devices: list[int], per_trial: int, concurrent: int) -> list[Slot]:
    """``concurrent`` slots of ``per_trial`` devices (0: as many as fit); refused when a trial
    needs more devices than there are."""
    what = "GPUs" if kind == "cuda" else "CPU cores"
    if per_trial > len(devices):
        raise ConfigError(f"devices_per_trial={per_trial} but this machine has {len(devices)} "
                          f"{what} ({', '.join(map(str, devices))}); use at most "
                          f"{len(devices)}")
    fit = len(devices) // per_trial
    if concurrent > fit:
        raise ConfigError(f"concurrent={concurrent} trials of {per_trial} {what} each need "
                          f"{concurrent * per_trial}, but there are {len(devices)}; use "
                          f"concurrent <= {fit} or fewer devices_per_trial")
    count = concurrent or fit
    slots = [Slot(i, kind, tuple(devices[i * per_trial:(i + 1) * per_trial]))
             for i in range(count)]
    used = [d for slot in slots for d in slot.devices]  # each device in one slot at most
    assert len(set(used)) == len(used) == count * per_trial and set(used) <= set(devices), slots
    return slots


def check_layout_fits(slot_size: int, kind: str, processes: int, layout: str) -> None:
    """On GPUs each rank needs a device of its own within the trial's slot."""
    if kind == "cuda" and processes > slot_size:
        raise ConfigError(f"layout {layout!r} runs {processes} processes, but a trial gets "
                          f"{slot_size} GPU(s); raise devices_per_trial to {processes}")


def preexec(slot: Slot):
    """What runs in a trial's process before the command: its own process group (so the sweep
    can stop it whole), the death signal of its parent, and on a CPU the slot's cores."""

    def run():
        os.setsid()
        try:  # Linux: die with the sweep (PR_SET_PDEATHSIG = 1)
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)
        except OSError:  # pragma: no cover - not Linux
            pass
        if slot.kind == "cpu":
            os.sched_setaffinity(0, set(slot.devices))

    return run
