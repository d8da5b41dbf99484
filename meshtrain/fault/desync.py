"""Collective desync diagnosis: which ranks disagree on the next collective, and where each is.

:func:`enable_collective_checks` (before ``init_process_group``) turns on PyTorch's own checks:
groups created afterwards are wrapped in ``ProcessGroupWrapper``, which before each collective runs
a monitored barrier and compares collective fingerprints (sequence number, op, shapes, dtypes)
through a helper gloo group, raising ``RuntimeError`` on the ranks that disagree. It cannot say
where in the program a rank is (and garbles the other rank's op when ops differ):
:class:`collective_check_context` turns its error into a :class:`CollectiveMismatch` naming the
ranks, what each was about to run and each one's Python call site, exchanged through the c10d
store (a rank that did not raise answers from a thread with where its main thread is now).

torch 2.13 + gloo, measured: checked are c10d collectives on the world group, ``new_group`` and
DeviceMesh groups, FSDP2, DDP's reducer and functional ``all_reduce``; not checked are functional
all_gather / reduce_scatter / all_to_all (DTensor redistribution, TP) and point-to-point ops. A
skipped collective among identical ones is seen when another rank waits for it: the monitored
barrier names the missing rank after the group's timeout. Cost: ~3-8 ms more per collective.
With the checks on, meshtrain's shared-memory groups (``local_comm``) are not made: the pipeline,
FSDP and the tp axis keep gloo's, which the checks wrap.
"""

from __future__ import annotations

import json
import os
import re
import sys
import threading
import time
import traceback
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist

import meshtrain
from meshtrain.errors import CollectiveMismatch

KEY = "meshtrain/desync"  # store keys: {KEY}/rank{r} where rank r is; {KEY}/request a request
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_MESHTRAIN_DIR = os.path.dirname(meshtrain.__file__) + os.sep
_STDLIB_DIR = os.path.dirname(os.__file__) + os.sep


def enable_collective_checks() -> None:
    """Wrap process groups created from now on in ProcessGroupWrapper (debug level DETAIL).

    Works around a torch 2.13 crash too: DDP's construction-time usage log casts the gloo backend,
    now the wrapper, to ProcessGroupGloo and segfaults; that log (telemetry only) is skipped.
    """
    dist.set_debug_level(dist.DebugLevel.DETAIL)
    dist.Logger = _DDPLoggerWithoutConstructionLog


class _DDPLoggerWithoutConstructionLog(torch._C._distributed_c10d.Logger):
    def set_construction_data_and_log(self, *args, **kwargs) -> None:
        pass


def _checks_on() -> bool:
    return dist.get_debug_level() == dist.DebugLevel.DETAIL


def set_collective_timeout(seconds: float, groups=None) -> list:
    """Set how long collectives wait before raising, after the groups exist; return the groups.

    ``groups``: None for every process group this rank belongs to (``new_group`` and DeviceMesh
    subgroups get torch's 30-min default, not the ``init_process_group`` timeout), a ProcessGroup,
    a DeviceMesh (all its dimensions) or a list of these. Under collective checks the wrapper's
    monitored barrier keeps the timeout its group was created with: a skip is reported that late.
    """
    from torch.distributed.device_mesh import DeviceMesh

    from meshtrain.parallel.shm.p2p import LocalP2PGroup

    if groups is None:
        groups = list(dist.distributed_c10d._world.pg_map)
    elif isinstance(groups, (dist.ProcessGroup, DeviceMesh)):
        groups = [groups]
    flat = [g for item in groups
            for g in (item.get_all_groups() if isinstance(item, DeviceMesh) else [item])]
    flat, wrapped = list(dict.fromkeys(flat)), False
    for group in flat:
        if isinstance(group, LocalP2PGroup):  # meshtrain's shared-memory groups (Python)
            group.set_timeout(timedelta(seconds=seconds))
            continue
        for device in group._device_types:
            backend = group._get_backend(device)
            if isinstance(backend, torch._C._distributed_c10d._ProcessGroupWrapper):
                wrapped, backend = True, backend.wrapped_pg
            backend._set_default_timeout(timedelta(seconds=seconds))
    if wrapped:
        warnings.warn("collective checks are on: ProcessGroupWrapper's monitored barrier keeps "
                      "the timeout each group was created with", stacklevel=2)
    return flat


def _short(path: str) -> str:
    if path.startswith(_MESHTRAIN_DIR):
        return "meshtrain/" + path[len(_MESHTRAIN_DIR):]
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel


def _position(frames: list) -> tuple[str, str]:
    """(call site, torch entry) of (file, line, function) frames listed outermost first.

    The call site is the innermost frame outside torch, meshtrain and the standard library, with
    the innermost meshtrain frame below it added as "via"; the entry is the c10d function called.
    """
    frames = [f for f in frames if f[0] != __file__]
    start = len(frames)  # of the innermost run of torch frames
    while start > 0 and frames[start - 1][0].startswith(_TORCH_DIR):
        start -= 1
    c10d = [f for f in frames[start:] if f[0].endswith(("distributed_c10d.py", "_collectives.py"))]
    if c10d:
        op = c10d[-1][2]
    elif start < len(frames):  # e.g. DDP's forward or backward: the innermost torch frame
        op = f"{frames[-1][2]} (torch/{frames[-1][0][len(_TORCH_DIR):]})"
    else:
        op = ""
    outside = [f for f in frames[:start]
               if not (f[0].startswith((_STDLIB_DIR, "<")) and "-packages" not in f[0])]
    user = [f for f in outside if not f[0].startswith(_MESHTRAIN_DIR)]
    if not outside:
        return "?", op
    site = user[-1] if user else outside[-1]
    text = f"{_short(site[0])}:{site[1]} in {site[2]}"
    if user and outside[-1] is not site:
        text += f" (via {_short(outside[-1][0])}:{outside[-1][1]} in {outside[-1][2]})"
    return text, op


def _frames(walk) -> list:
    return [(frame.f_code.co_filename, line, frame.f_code.co_name) for frame, line in walk]


_MISMATCH = "Detected mismatch between collectives on ranks"
_RUNNING = re.compile(r"Rank (\d+) is running collective: ")
_MISSING = re.compile(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier")
_PEER_FAILED = re.compile(r"successfully reached monitoredBarrier, but received errors while "
                          r"waiting for send/recv from rank (\d+)")


def _fingerprint_at(text: str, start: int) -> str:
    depth, end = 0, start
    for end in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[end], 0)
        if depth == 0 and text[end] == ")":
            break
    fingerprint = text[start:end + 1].split(", TensorDeviceTypes=")[0].rstrip(")") + ")"
    return re.sub(r"(SequenceNumber=\d+)(?=OpType)", r"\1, ", fingerprint)


def _parse(error: BaseException | None):
    """(kind, this rank's fingerprint, {rank: torch's fingerprint of it}, ranks named) or None."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        text = str(error)
        found = [(int(m[1]), _fingerprint_at(text, m.end())) for m in _RUNNING.finditer(text)]
        if _MISMATCH in text and found:
            return "mismatch", found[0][1], dict(found[1:]), tuple(r for r, _ in found[1:])
        if m := _MISSING.search(text):
            return "missing", None, {}, tuple(int(r) for r in re.findall(r"\d+", m[1]))
        if m := _PEER_FAILED.search(text):
            return "peer_failed", None, {}, (int(m[1]),)
        error = error.__cause__ or error.__context__
    return None


def _collect(store, ranks, wait_s: float, settle_s: float) -> dict:
    """The records of ``ranks``; a live one may be replaced by an error one for ``settle_s``."""
    records, deadline, settle = {}, time.monotonic() + wait_s, None
    while True:
        for r in ranks:
            key = f"{KEY}/rank{r}"
            if records.get(r, {"source": "live"})["source"] == "live" and store.check([key]):
                records[r] = json.loads(store.get(key))
        now = time.monotonic()
        if len(records) == len(ranks):
            if all(rec["source"] == "error" for rec in records.values()):
                return records
            settle = settle or now + settle_s
        if now > deadline or (settle and now >= settle):
            return records
        time.sleep(0.05)


class _Responder(threading.Thread):
    """Answers each request with where the watched thread is now, unless it published already."""

    def __init__(self, store, rank: int, thread_id: int):
        super().__init__(daemon=True, name="meshtrain-desync")
        self.store, self.rank, self.thread_id = store, rank, thread_id

    def run(self) -> None:
        answered = None
        while True:
            time.sleep(0.5)
            try:
                if not self.store.check([f"{KEY}/request"]):
                    continue
                request = self.store.get(f"{KEY}/request")
                if request != answered:
                    frame = sys._current_frames().get(self.thread_id)
                    frames = _frames(traceback.walk_stack(frame))[::-1] if frame else []
                    site, op = _position(frames)
                    live = json.dumps(dict(source="live", site=site, op=op))
                    self.store.compare_set(f"{KEY}/rank{self.rank}", "", live)  # if none yet
                    answered = request
            except Exception:
                return  # the store is gone: the job is ending


_responder: _Responder | None = None


def _describe(rank: int, record: dict | None, torch_view: str | None) -> str:
    if record is None:
        said = f"; torch's fingerprint of it: {torch_view}" if torch_view else ""
        return f"  rank {rank}: did not say where it is (exited, or runs without checks){said}"
    if record["source"] == "live":
        where = f"in {record['op']} " if record["op"] else "not in a collective, "
        return f"  rank {rank}: now {where}at {record['site']}"
    what = " ".join(filter(None, [record["op"], record.get("fingerprint")]))
    return f"  rank {rank}: {what or 'a collective'} at {record['site']}"


def explain_collective_error(error: BaseException, store, rank: int, world_size: int,
                             wait_s: float = 5.0) -> CollectiveMismatch | None:
    """A CollectiveMismatch for a ProcessGroupWrapper error (else None) with each named rank's
    call site: publishes this rank's, asks the others, waits up to ``wait_s`` for theirs."""
    parsed = _parse(error)
    if parsed is None:
        return None
    kind, fingerprint, torch_views, named = parsed
    named = tuple(r for r in named if 0 <= r < world_size and r != rank)
    site, op = _position(_frames(traceback.walk_tb(error.__traceback__)))
    mine = dict(source="error", site=site, op=op, fingerprint=fingerprint)
    records = {}
    if store is not None:
        try:
            store.set(f"{KEY}/rank{rank}", json.dumps(mine))
            store.set(f"{KEY}/request", f"{rank}:{time.time()}")
            records = _collect(store, named, wait_s, 1.0 if kind == "mismatch" else 0.0)
        except Exception:
            pass  # the store is gone: say what this rank knows
    lines = [_describe(rank, mine, None)]
    lines += [_describe(r, records.get(r), torch_views.get(r)) for r in named]
    others = ", ".join(map(str, named))
    if kind == "mismatch":
        ranks = tuple(sorted({rank, *named}))
        head = (f"ranks {' and '.join(map(str, ranks))} were about to run different collectives "
                "(ProcessGroupWrapper collective fingerprints):")
        tail = "Every rank must run the same collectives in the same order, shapes and dtypes."
    elif kind == "missing":
        ranks = named
        head = (f"rank(s) {others} did not reach the collective that rank {rank} was about to "
                "run (ProcessGroupWrapper monitored barrier: exited, or not there within the "
                "group's timeout):")
        tail = "A rank skipped a collective, or is stuck or slow before it."
    else:
        ranks = named
        head = (f"rank {rank} reached its collective, but the check failed on rank {others} (see "
                "its error; it may run a collective the checks do not see, e.g. a functional "
                "all_gather):")
        tail = ""
    return CollectiveMismatch("\n".join(filter(None, [head, *lines, tail])), ranks=ranks)


class collective_check_context:
    """``with collective_check_context(): step()`` raises CollectiveMismatch (from the original)
    for ProcessGroupWrapper errors. Store, rank and world size default to the default group's."""

    def __init__(self, store=None, rank: int | None = None, world_size: int | None = None,
                 wait_s: float = 5.0):
        self.store, self.rank, self.world_size, self.wait_s = store, rank, world_size, wait_s

    def __enter__(self):
        global _responder
        if dist.is_initialized():
            if self.store is None:
                self.store = dist.distributed_c10d._get_default_store()
            self.rank = dist.get_rank() if self.rank is None else self.rank
            self.world_size = self.world_size or dist.get_world_size()
        if _responder is None and self.store is not None and _checks_on():
            _responder = _Responder(self.store, self.rank or 0, threading.get_ident())
            _responder.start()
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc is None or isinstance(exc, CollectiveMismatch):
            return False
        mismatch = explain_collective_error(exc, self.store, self.rank or 0,
                                            self.world_size or 1, self.wait_s)
        if mismatch is None:
            return False
        raise mismatch from exc
