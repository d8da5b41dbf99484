"""Faults at named points of a training step, armed by name, step and rank: for meshtrain's own
tests and for checking that a cluster recovers from each of them.

Armed through the environment (every process of the job inherits it)::

    MESHTRAIN_FAULT="point:step:rank[:kind[:attempts]]"      several: separated by ","

e.g. ``MESHTRAIN_FAULT=checkpoint_shard:4:1:kill`` SIGKILLs rank 1 once it has written its part
of the checkpoint of step 4. ``step`` is the optimizer step (1-based; a checkpoint's is the
step it saves); ``rank`` the global rank, or ``*`` for every rank; ``attempts``: ``first`` (the
default: only before any restart, so a restarted job recovers) or ``all`` (every attempt: a
failure that a restart cannot fix). From Python, :func:`arm` does the same (tests).

Off by default: :func:`fault_point` is then a call and one dict lookup. Each fault fires once per
process. The points (:data:`POINTS`) and what they can do (:data:`KINDS`) are listed below;
docs/fault_tolerance.md shows them in use.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import signal
import sys
import time

import torch

from meshtrain.errors import ConfigError, MeshtrainError

ENV = "MESHTRAIN_FAULT"

POINTS = {
    "step_start": "the start of an optimizer step, before its first forward",
    "gradient_allreduce": "before the gradient all-reduce: the last micro-batch's backward is "
                          "about to run (under dp, each gradient as backward computes it, "
                          "before DDP reduces it: bitflip/permute corrupt the first one)",
    "checkpoint_shard": "a checkpoint save, after this rank wrote its first shard file",
    "pipeline_p2p": "a pipeline stage's forward of a micro-batch, between receiving its input "
                    "and sending its output (the other stages mid send/receive)",
    "moe_all_to_all": "an MoE layer's dispatch under ep, between the all-to-all of the token "
                      "counts and that of the tokens",
    "optimizer_step": "inside optimizer.step(), before any parameter changes",
}
KINDS = {
    "kill": "SIGKILL this process (a crash: nothing is recorded)",
    "raise": "raise InjectedFault (a Python error in the rank)",
    "exit": "os._exit(1) without cleaning up",
    "stall": "sleep for an hour (a hung rank)",
    "stop": "SIGSTOP this process (a frozen rank)",
    "enospc": "raise OSError(ENOSPC): no space left on the device",
    "eacces": "raise PermissionError(EACCES)",
    "bitflip": "flip the lowest bit of the first element of the tensor at the point (a "
               "gradient: silent data corruption)",
    "permute": "reverse the order of the tensor's elements (a gradient)",
}
CORRUPTING = ("bitflip", "permute")  # need a tensor: they change it, nothing else happens


class InjectedFault(MeshtrainError, RuntimeError):
    """The error of a fault of kind "raise"."""


@dataclasses.dataclass
class Fault:
    point: str
    step: int
    rank: int | None  # None: every rank
    kind: str = "kill"
    every_attempt: bool = False
    fired: bool = False

    def __str__(self) -> str:
        rank = "*" if self.rank is None else self.rank
        return f"{self.point}:{self.step}:{rank}:{self.kind}"


ARMED: dict[str, list[Fault]] = {}  # point -> its faults; empty: every fault_point returns
_where = {"step": 0, "rank": None}


def parse(text: str) -> list[Fault]:
    """The faults of a ``MESHTRAIN_FAULT`` value (ConfigError, with the format, if malformed)."""
    faults = []
    form = (f"{ENV} takes point:step:rank[:kind[:attempts]] (several separated by ','), e.g. "
            f"checkpoint_shard:4:1:kill; points: {', '.join(POINTS)}; kinds: {', '.join(KINDS)}; "
            "attempts: first or all")
    for item in filter(None, (part.strip() for part in text.split(","))):
        fields = item.split(":")
        if not 3 <= len(fields) <= 5:
            raise ConfigError(f"{ENV}={text!r}: {item!r} is not a fault; {form}")
        point, step, rank, kind, attempts = (*fields, *("kill", "first")[len(fields) - 3:])
        if point not in POINTS:
            raise ConfigError(f"{ENV}: unknown point {point!r}; {form}")
        if kind not in KINDS:
            raise ConfigError(f"{ENV}: unknown kind {kind!r}; {form}")
        if not step.isdigit() or int(step) < 1 or not (rank == "*" or rank.isdigit()):
            raise ConfigError(f"{ENV}: {item!r} needs a step >= 1 and a rank (or *); {form}")
        if attempts not in ("first", "all"):
            raise ConfigError(f"{ENV}: attempts must be 'first' or 'all', got {attempts!r}; "
                              f"{form}")
        faults.append(Fault(point, int(step), None if rank == "*" else int(rank), kind,
                            attempts == "all"))
    return faults


def load(environ=os.environ) -> None:
    """Arm the faults ``MESHTRAIN_FAULT`` names (none: disarm); the StepGuard calls it when a
    fit starts, so a malformed value is refused there (ConfigError), in every rank."""
    text = environ.get(ENV, "")
    if _loaded.get("text") == text:
        return
    ARMED.clear()
    for fault in parse(text):
        ARMED.setdefault(fault.point, []).append(fault)
    _loaded["text"] = text


_loaded: dict[str, str] = {}


def arm(spec: str) -> None:
    """Arm ``spec`` (the ``MESHTRAIN_FAULT`` format) here and, through the environment, in the
    processes this one starts from now on. ``arm("")`` disarms."""
    if spec:
        os.environ[ENV] = spec
    else:
        os.environ.pop(ENV, None)
    load()


def set_step(step: int) -> None:
    """The optimizer step now running (the StepGuard sets it, only while faults are armed)."""
    _where["step"] = step


def set_rank(rank: int) -> None:
    _where["rank"] = rank


def armed(point: str, step: int | None = None, corrupting: bool | None = None) -> bool:
    """Is a fault still to fire at ``point`` (at ``step``, on this rank; of a corrupting kind
    or not)?"""
    return point in ARMED and any(
        _due(f, step) and (corrupting is None or (f.kind in CORRUPTING) == corrupting)
        for f in ARMED[point])


def fault_point(point: str, tensor: torch.Tensor | None = None, step: int | None = None):
    """Fire the fault armed here for this step and rank, if any. With ``tensor``, a corrupting
    fault changes it (bitflip, permute: returns the changed tensor); without, only the other
    kinds fire. Returns ``tensor`` (changed or not). ``step``: the step this point belongs to
    when it is not the one running (a checkpoint written in the background)."""
    if point not in ARMED:
        return tensor
    for fault in ARMED[point]:
        if _due(fault, step) and (fault.kind in CORRUPTING) == (tensor is not None):
            fault.fired = True
            return _fire(fault, tensor)
    return tensor


def _rank() -> int:
    if _where["rank"] is None:
        _where["rank"] = int(os.environ.get("RANK", "0"))
    return _where["rank"]


def _attempt() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def _due(fault: Fault, step: int | None) -> bool:
    return (not fault.fired and fault.step == (_where["step"] if step is None else step)
            and fault.rank in (None, _rank()) and (fault.every_attempt or _attempt() == 0))


def _fire(fault: Fault, tensor):
    where = f"{fault.point} (step {fault.step}, rank {_rank()})"  # (alike in every attempt)
    print(f"meshtrain: injected fault '{fault.kind}' at {where}, attempt {_attempt()} ({ENV})",
          file=sys.stderr, flush=True)
    kind = fault.kind
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    if kind == "exit":
        os._exit(1)
    if kind == "stall":
        time.sleep(3600)
    if kind == "raise":
        raise InjectedFault(f"injected fault at {where}")
    if kind == "enospc":
        raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} (injected at {where})")
    if kind == "eacces":
        raise PermissionError(errno.EACCES, f"{os.strerror(errno.EACCES)} (injected at {where})")
    return corrupt(tensor, kind)


def corrupt_first_gradient(model: torch.nn.Module) -> None:
    """(A corrupting fault armed at "gradient_allreduce" for this step.) The first gradient
    backward computes for the model's first trainable parameter goes through
    :func:`fault_point` once, before it is accumulated (and under DDP before it is reduced)."""
    param = next((p for p in model.parameters() if p.requires_grad), None)
    if param is None:
        return
    handle = None

    def hook(grad):
        handle.remove()
        return fault_point("gradient_allreduce", grad)

    handle = param.register_hook(hook)


def corrupt(tensor: torch.Tensor, kind: str) -> torch.Tensor:
    """A copy of ``tensor`` with its first element's lowest bit flipped ("bitflip": still
    finite, almost the same value) or its elements in reverse order ("permute")."""
    out = tensor.detach().clone()
    flat = out.view(-1)
    if kind == "permute":
        return flat.flip(0).view(out.shape)
    bits = flat.view({8: torch.int64, 4: torch.int32, 2: torch.int16}[out.element_size()])
    bits[0] ^= 1
    return out
