"""Desync diagnosis on 2 gloo ranks: under collective checks (ProcessGroupWrapper) a rank that skips
a collective is named with every rank's call site; without them a short timeout still ends the run;
set_collective_timeout shortens the wait after the groups exist. Which timeout applies is read back
from the process groups and from torch's error text, not timed."""

import inspect
import re
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from meshtrain.errors import CollectiveMismatch, WorkerFailed
from meshtrain.launch.spawn import DistEnv, init_process_group, run_workers
from meshtrain.fault.desync import (
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


def _timeout_s(group) -> float:
    """The timeout the group's CPU backend applies (under the checks: the wrapped gloo group's)."""
    backend = group._get_backend(torch.device("cpu"))
    if isinstance(backend, torch._C._distributed_c10d._ProcessGroupWrapper):
        backend = backend.wrapped_pg
    return backend.options._timeout.total_seconds()


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
    """(error type, message, ranks named, torch's error it was raised from, the world group's
    timeout in seconds)."""
    env = _init(checks, timeout_s)
    timeout = _timeout_s(dist.group.WORLD)
    try:
        with collective_check_context():
            skipping_step(1, env.rank, then_end)
        with collective_check_context():
            skipping_step(2, env.rank, then_end)
        return ("ok", "", (), "", timeout)
    except Exception as error:  # reported, not raised: both ranks' errors are compared
        return (type(error).__name__, str(error), getattr(error, "ranks", ()),
                str(error.__cause__ or ""), timeout)
    finally:
        if env.rank == 0:
            _store().set(DONE, "1")


@pytest.mark.timeout(120)
def test_skipped_collective_names_both_ranks_and_call_sites():
    """Rank 1 skips the first all_reduce of step 2 and runs the second: a shape mismatch."""
    results = run_workers(_run_steps, 2, (True, False, 30.0), timeout=90)
    grads = _line(skipping_step, "MARK grads")
    loss = _line(skipping_step, "MARK loss")
    for rank, (kind, message, ranks, cause, timeout) in enumerate(results):
        print(f"rank {rank}: {kind}\n{message}\nfrom: {cause}")
        assert timeout == 30.0
        # found by comparing fingerprints at the collective, not by waiting out the 30 s timeout
        assert "Detected mismatch between collectives" in cause, cause
        assert "monitoredBarrier" not in cause, cause
        assert kind == "CollectiveMismatch", message
        assert ranks == (0, 1)
        assert "ranks 0 and 1 were about to run different collectives" in message
        assert re.search(rf"rank 0: all_reduce .*TensorShape=\[4\].* at \S*test_desync.py:{grads} "
                         "in skipping_step", message), message
        assert re.search(rf"rank 1: all_reduce .*TensorShape=\[2\].* at \S*test_desync.py:{loss} "
                         "in skipping_step", message), message


@pytest.mark.timeout(120)
def test_rank_that_skips_and_stays_away_is_named_after_the_timeout():
    """Rank 1 skips and then waits elsewhere: rank 0's monitored barrier names it after 3 s."""
    results = run_workers(_run_steps, 2, (True, True, 3.0), timeout=90)
    kind, message, ranks, cause, timeout = results[0]
    print(f"rank 0: {kind}\n{message}\nfrom: {cause}")
    assert timeout == 3.0
    # the monitored barrier gave up after the group's timeout: 3 s
    assert "Ranks 1 failed to pass monitoredBarrier in 3000 ms" in cause, cause
    assert kind == "CollectiveMismatch", message
    assert ranks == (1,)
    assert "rank(s) 1 did not reach the collective that rank 0 was about to run" in message
    grads = _line(skipping_step, "MARK grads")
    assert re.search(rf"rank 0: all_reduce at \S*test_desync.py:{grads} in skipping_step", message)
    # rank 1 answered from its responder thread with where it is now
    assert re.search(r"rank 1: now not in a collective, at \S*test_desync.py:\d+ in "
                     "idle_after_skip", message), message
    assert results[1][0] == "ok"


def _skip_without_checks(timeout_s: float, shorten_to: float | None):
    env = _init(False, timeout_s)
    subgroup = dist.new_group([0, 1])
    groups = {"world": dist.group.WORLD, "subgroup": subgroup}
    before = {name: _timeout_s(group) for name, group in groups.items()}
    if shorten_to is not None:
        changed = set_collective_timeout(shorten_to)
        assert dist.group.WORLD in changed and subgroup in changed
    after = {name: _timeout_s(group) for name, group in groups.items()}
    timeouts = ", ".join(f"{name} timeout {before[name]:g} s -> {after[name]:g} s"
                         for name in groups)
    dist.barrier()
    if env.rank == 1:
        idle_after_skip(1)
        return None
    try:
        dist.all_reduce(torch.ones(4))
    except RuntimeError as error:
        raise RuntimeError(f"rank 0 failed ({timeouts})") from error
    finally:
        _store().set(DONE, "1")


def _timeouts(info: pytest.ExceptionInfo) -> dict[str, str]:
    """{group: "before->after"} of the timeouts that rank 0 read back from its process groups."""
    text = str(info.value)
    print(text[-1500:])
    found = re.search(r"rank 0 failed \(world timeout (\S+) s -> (\S+) s, subgroup timeout (\S+) s "
                      r"-> (\S+) s\)", text)
    assert found, text
    return {"world": f"{found[1]}->{found[2]}", "subgroup": f"{found[3]}->{found[4]}"}


@pytest.mark.timeout(120)
def test_without_checks_a_skip_fails_within_the_timeout():
    with pytest.raises(WorkerFailed) as info:
        run_workers(_skip_without_checks, 2, (3.0, None), timeout=90)
    # the all_reduce on the world group waited its timeout, the init_process_group one
    assert "Timed out waiting 3000ms" in str(info.value)
    assert _timeouts(info) == {
        "world": "3->3",
        "subgroup": "1800->1800",  # new_group does not inherit the init_process_group timeout
    }


@pytest.mark.timeout(120)
def test_set_collective_timeout_shortens_the_wait():
    with pytest.raises(WorkerFailed) as info:
        run_workers(_skip_without_checks, 2, (600.0, 2.0), timeout=90)
    assert "Timed out waiting 2000ms" in str(info.value)  # not 600000ms
    assert _timeouts(info) == {"world": "600->2", "subgroup": "1800->2"}


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
