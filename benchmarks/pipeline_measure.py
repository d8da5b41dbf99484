"""What pipeline.py measures around a schedule's compute: the host time of a step (its wall time
less compute and waiting), and the handoffs between ranks read off a recorded timeline."""

from __future__ import annotations

import statistics
import time


def host_split(runner, x, y) -> tuple[float, float, float, float]:
    """One step of ``runner`` on this rank, split (seconds): wall, F/B compute, posting p2p
    (``torch.distributed.pipelining``'s ``_batch_p2p``, or meshtrain's loop's ``_post``) and
    waiting for it (``_wait_batch_p2p`` or ``_wait``: the other rank's turn, the transfer, the
    copy out). What is left of the wall is the
    schedule's own Python and meshtrain's work around it; with the posting, the host time."""
    from torch.distributed.pipelining import schedules

    from meshtrain.parallel.pipeline import runtime

    spent = {"post": 0.0, "wait": 0.0}

    def timed(fn, key):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[key] += time.perf_counter() - start
        return wrapper

    post, wait = schedules._batch_p2p, schedules._wait_batch_p2p
    lean_post, lean_wait = runtime._post, runtime._wait  # meshtrain's loop (runtime.py)
    schedules._batch_p2p, schedules._wait_batch_p2p = timed(post, "post"), timed(wait, "wait")
    runtime._post, runtime._wait = timed(lean_post, "post"), timed(lean_wait, "wait")
    try:
        start = time.perf_counter()
        _, compute = runner.step_compute_time(x, y)
        wall = time.perf_counter() - start
    finally:
        schedules._batch_p2p, schedules._wait_batch_p2p = post, wait
        runtime._post, runtime._wait = lean_post, lean_wait
    return wall, compute, spent["post"], spent["wait"]


def timeline_events(rows):
    from meshtrain.parallel.pipeline import TimelineEvent

    return [TimelineEvent(*row) for row in rows]


def handoffs(rows) -> list[tuple[int, int, str, float]]:
    """(stage, micro-batch, kind, ms) for every F (B) whose input comes from the previous (next)
    stage on the other rank and whose rank sat idle when that stage finished: the time from the
    producer's end to this action's start. With nothing else in the way, this is what handing
    one activation (gradient) over costs inside the schedule: the send/recv and the schedule's
    own work around it. The ranks' clocks are aligned by the barrier that starts the step, to
    about 0.5 ms (values slightly below 0 are that skew; with more ranks than cores, as
    ``--pp 4`` on 2 cores, the skew is milliseconds and the handoffs mean nothing)."""
    events = timeline_events(rows)
    by_key = {(e.stage, e.microbatch, e.kind): e for e in events}
    out = []
    for e in events:
        producer = by_key.get((e.stage - 1 if e.kind == "F" else e.stage + 1, e.microbatch,
                               e.kind))
        if producer is None or producer.rank == e.rank:
            continue
        before = [o.end for o in events if o.rank == e.rank and o.end <= e.start]
        if not before or max(before) <= producer.end:  # waiting for the producer
            out.append((e.stage, e.microbatch, e.kind, 1e3 * (e.start - producer.end)))
    return out


def host_per_action(ranks: list[dict], name: str, actions: int) -> dict:
    host, post = [], []
    for rank in ranks:
        splits = rank["host"][name]
        host.append(statistics.median((w - c - wt) / actions for w, c, _, wt in splits))
        post.append(statistics.median(p / actions for _, _, p, _ in splits))
    return {"host_ms_per_action": 1e3 * max(host), "post_ms_per_action": 1e3 * max(post)}
