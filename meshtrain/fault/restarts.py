"""Restarts that cannot help: a failure that repeats identically stops ``meshtrain run
--max-restarts``.

A deterministic bug (a bad sample, a shape error at step 5, a full disk at the save of step 4)
fails the same way after every restart: each one resumes from the last checkpoint and fails
again, until ``--max-restarts`` is used up. So:

* in the workers, when a rank's fit fails (not merely because a peer died: a lost connection
  is the other rank's failure), :func:`record_failure` writes what failed: the exception's
  type, the first line of its message and the step, into the folder ``meshtrain run`` gives
  its workers (``MESHTRAIN_FAILURE_RECORDS``, in its log folder). If the previous attempt of
  the same rank failed the same way at the same step, it also writes ``stop``, saying so;
* in ``meshtrain run`` (the agent), :func:`repeated_failures_stop_restarts` wraps torchrun's
  worker monitor: when a failed attempt left ``stop``, no restart is left; the job ends with
  the failure and one line says why.

A SIGKILLed rank, a stall (the watchdog's exit) or a failure before the first step's guard
exists record nothing: they restart as before. Under plain ``torchrun`` nothing is recorded.
On several nodes each agent reads its own node's records: the node of the failing rank stops
restarting, and the other agents then fail to meet it at their next rendezvous.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path

ENV = "MESHTRAIN_FAILURE_RECORDS"
STOP = "stop"


def _attempt() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def failure_of(error: BaseException, step: int) -> dict:
    message = str(error).strip().splitlines()
    return {"type": f"{type(error).__module__}.{type(error).__qualname__}",
            "message": message[0] if message else "", "step": step}


def record_failure(error: BaseException, step: int, rank: int) -> Path | None:
    """Record this rank's failure of this attempt (see the module's docstring); the ``stop``
    file when it repeats the previous attempt's. No-op outside ``meshtrain run``."""
    from meshtrain.launch.endings import lost_peer

    folder = os.environ.get(ENV)
    if not folder or lost_peer(error):
        return None
    folder, attempt = Path(folder), _attempt()
    failure = failure_of(error, step)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"attempt{attempt}_rank{rank}.json").write_text(json.dumps(failure))
        before = folder / f"attempt{attempt - 1}_rank{rank}.json"
        if attempt > 0 and before.is_file() and json.loads(before.read_text()) == failure:
            where = f"step {step}" if step else "start-up, before the first step"
            reason = (f"rank {rank} failed at {where} with {failure['type'].rsplit('.', 1)[-1]}"
                      f": {failure['message']!r}, as in the attempt before (a restart resumes "
                      "to the same failure)")
            tmp = folder / f".{STOP}.{os.getpid()}"
            tmp.write_text(reason)
            os.replace(tmp, folder / STOP)
            return folder / STOP
    except OSError:  # the agent's folder is gone: restarts go on as before
        return None
    return None


def start_failed(trainer, error: BaseException) -> None:
    """(Fit's preparation failed on this rank.) Record it as a failure before the first step,
    and give back the run folder's lock if this rank took it (checkpoint/run_lock.py)."""
    from meshtrain.checkpoint.run_lock import release

    record_failure(error, 0, trainer.rank)
    if trainer.run_dir is not None:
        release(trainer.run_dir)


def stop_reason(folder) -> str | None:
    """Why restarts must stop (the ``stop`` file a worker wrote), or None."""
    try:
        return (Path(folder) / STOP).read_text()
    except OSError:
        return None


@contextlib.contextmanager
def repeated_failures_stop_restarts(log_dir: str):
    """(``meshtrain run``.) Workers record failures under ``log_dir``; a failed attempt that
    repeated the one before leaves torchrun's agent no restart, said on stderr."""
    from torch.distributed.elastic.agent.server.api import WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    folder = Path(log_dir) / "meshtrain_failures"
    monitor = LocalElasticAgent._monitor_workers

    def monitored(agent, worker_group):
        result = monitor(agent, worker_group)
        if result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY) and \
                agent._remaining_restarts > 0 and (reason := stop_reason(folder)):
            print(f"meshtrain run: not restarting again ({agent._remaining_restarts} of "
                  f"--max-restarts {worker_group.spec.max_restarts} left): {reason}.",
                  file=sys.stderr, flush=True)
            agent._remaining_restarts = 0
        return result

    previous = os.environ.get(ENV)
    os.environ[ENV] = str(folder)
    LocalElasticAgent._monitor_workers = monitored
    try:
        yield
    finally:
        LocalElasticAgent._monitor_workers = monitor
        if previous is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = previous
