"""Desync diagnosis on 2 gloo ranks: under collective checks (ProcessGroupWrapper) a rank that skips
a collective is named with every rank's call site; without them a short timeout still ends the run;
set_collective_timeout shortens the wait after the groups exist."""

import inspect
import re
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from meshtrain.errors import CollectiveMismatch, WorkerFailed
from meshtrain.launch.spawn import DistEnv, init_process_group, run_workers
from meshtrain.observe.desync import (
    collective_check_context,
    enable_collective_checks,
    set_collective_timeout,
)

DONE = "test/rank0_done"


def _line(function, marker: str) -> int:
    lines, first = inspect.getsourcelines(function)
    return first + next(i for i, text in enumerate(lines) if marker in text)


def _init(checks: bool, timeout_s: float) -> DistEnv:
    if checks:
        enable_collective_checks()
    env = DistEnv.from_environ()
    init_process_group(env, "gloo", timedelta(seconds=timeout_s))
    return env


def _store():
    return dist.distributed_c10d._get_default_store()


def idle_after_skip(rank: int) -> None:
    """Rank 1, having skipped a collective, stays alive until rank 0 has its error."""
    if rank == 1:
        deadline = time.monotonic() + 60
        while not _store().check([DONE]) and time.monotonic() < deadline:
            time.sleep(0.05)


def skipping_step(step: int, rank: int, then_end: bool) -> None:
    if not (rank == 1 and step == 2):
        dist.all_reduce(torch.ones(4))  # MARK grads: rank 1 skips this in step 2
    elif then_end:
        idle_after_skip(rank)
        return
    dist.all_reduce(torch.ones(2))  # MARK loss


def _run_steps(checks: bool, then_end: bool, timeout_s: float):
    env = _init(checks, timeout_s)
    start = time.monotonic()
    try:
        with collective_check_context():
            skipping_step(1, env.rank, then_end)
        start = time.monotonic()
        with collective_check_context():
            skipping_step(2, env.rank, then_end)
        return ("ok", "", (), time.monotonic() - start)
    except Exception as error:  # reported, not raised: both ranks' errors are compared
        return (type(error).__name__, str(error), getattr(error, "ranks", ()),
                time.monotonic() - start)
    finally:
        if env.rank == 0:
            _store().set(DONE, "1")


@pytest.mark.timeout(120)
def test_skipped_collective_names_both_ranks_and_call_sites():
    """Rank 1 skips the first all_reduce of step 2 and runs the second: a shape mismatch."""
    results = run_workers(_run_steps, 2, (True, False, 30.0), timeout=90)
    grads = _line(skipping_step, "MARK grads")
    loss = _line(skipping_step, "MARK loss")
    for rank, (kind, message, ranks, elapsed) in enumerate(results):
        print(f"rank {rank}: {kind} after {elapsed:.2f} s\n{message}")
        assert kind == "CollectiveMismatch", message
        assert ranks == (0, 1)
        assert "ranks 0 and 1 were about to run different collectives" in message
        assert re.search(rf"rank 0: all_reduce .*TensorShape=\[4\].* at \S*test_desync.py:{grads} "
                         "in skipping_step", message), message
        assert re.search(rf"rank 1: all_reduce .*TensorShape=\[2\].* at \S*test_desync.py:{loss} "
                         "in skipping_step", message), message
        assert elapsed < 10


@pytest.mark.timeout(120)
def test_rank_that_skips_and_stays_away_is_named_after_the_timeout():
    """Rank 1 skips and then waits elsewhere: rank 0's monitored barrier names it after 3 s."""
    results = run_workers(_run_steps, 2, (True, True, 3.0), timeout=90)
    kind, message, ranks, elapsed = results[0]
    print(f"rank 0: {kind} after {elapsed:.2f} s\n{message}")
    assert kind == "CollectiveMismatch", message
    assert ranks == (1,)
    assert "rank(s) 1 did not reach the collective that rank 0 was about to run" in message
    grads = _line(skipping_step, "MARK grads")
    assert re.search(rf"rank 0: all_reduce at \S*test_desync.py:{grads} in skipping_step", message)
    # rank 1 answered from its responder thread with where it is now
    assert re.search(r"rank 1: now not in a collective, at \S*test_desync.py:\d+ in "
                     "idle_after_skip", message), message
    assert 3 <= elapsed < 3 + 8
    assert results[1][0] == "ok"


def _skip_without_checks(timeout_s: float, shorten_to: float | None):
    env = _init(False, timeout_s)
    subgroup = dist.new_group([0, 1])
    before = subgroup._get_backend(torch.device("cpu")).options._timeout.total_seconds()
    if shorten_to is not None:
        changed = set_collective_timeout(shorten_to)
        assert dist.group.WORLD in changed and subgroup in changed
    after = subgroup._get_backend(torch.device("cpu")).options._timeout.total_seconds()
    dist.barrier()
    if env.rank == 1:
        idle_after_skip(1)
        return None
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(4))
    except RuntimeError as error:
        raise RuntimeError(f"rank 0 failed after {time.monotonic() - start:.2f} s "
                           f"(subgroup timeout {before:g} s -> {after:g} s)") from error
    finally:
        _store().set(DONE, "1")


def _failure_seconds(info: pytest.ExceptionInfo) -> tuple[float, str]:
    text = str(info.value)
    print(text[-1500:])
    found = re.search(r"rank 0 failed after ([\d.]+) s \(subgroup timeout (\S+) s -> (\S+) s\)",
                      text)
    assert found, text
    return float(found.group(1)), f"{found.group(2)}->{found.group(3)}"


@pytest.mark.timeout(120)
def test_without_checks_a_skip_fails_within_the_timeout():
    with pytest.raises(WorkerFailed) as info:
        run_workers(_skip_without_checks, 2, (3.0, None), timeout=90)
    seconds, subgroup = _failure_seconds(info)
    assert "Timed out waiting 3000ms" in str(info.value)
    assert 3 <= seconds < 3 + 2
    assert subgroup == "1800->1800"  # new_group does not inherit the init_process_group timeout


@pytest.mark.timeout(120)
def test_set_collective_timeout_shortens_the_wait():
    with pytest.raises(WorkerFailed) as info:
        run_workers(_skip_without_checks, 2, (600.0, 2.0), timeout=90)
    seconds, subgroup = _failure_seconds(info)
    assert "Timed out waiting 2000ms" in str(info.value)
    assert seconds < 15
    assert subgroup == "1800->2"


def _ddp_with_extra_collective():
    from torch.nn.parallel import DistributedDataParallel

    env = _init(True, 30.0)
    model = DistributedDataParallel(torch.nn.Linear(4, 4))  # segfaults without the workaround
    try:
        for step in range(3):
            with collective_check_context():
                if env.rank == 1 and step == 1:
                    dist.all_reduce(torch.ones(3))  # MARK extra
                model(torch.ones(2, 4)).sum().backward()  # MARK backward
        return ("ok", "")
    except CollectiveMismatch as error:
        return ("CollectiveMismatch", str(error))


@pytest.mark.timeout(120)
def test_ddp_reducer_collectives_are_checked():
    results = run_workers(_ddp_with_extra_collective, 2, (), timeout=90)
    extra = _line(_ddp_with_extra_collective, "MARK extra")
    for rank, (kind, message) in enumerate(results):
        print(f"rank {rank}: {kind}\n{message}")
        assert kind == "CollectiveMismatch", message
        assert re.search(rf"rank 1: all_reduce .*OpType=ALLREDUCE, TensorShape=\[3\].* at "
                         rf"\S*test_desync.py:{extra} in _ddp_with_extra_collective", message)
