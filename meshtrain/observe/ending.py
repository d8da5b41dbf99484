"""How a run ended, as its folder records it for a monitor and for ``meshtrain report``.

``environment.json``'s ``status`` is ``"running"`` from the start of ``fit`` until the run
ends, then one of :data:`STATUSES`:

* ``finished``: ``fit`` returned (every step, or a stop it chose: early stopping, ``max_time``);
* ``preempted``: stopped on a signal (``stop_on_signal``) after a resumable checkpoint;
* ``failed``: a rank raised; the rank whose error came first, not a survivor's broken connection;
* ``stopped_by_watchdog``: the stall watchdog stopped the job; the rank(s) that stopped advancing;
* ``killed``: a rank was killed by a signal it could not catch (SIGKILL: ``kill -9``, the
  out-of-memory killer), or the job was interrupted (Ctrl-C, SIGTERM to the launcher).

With it: ``finished`` (the time), ``error`` (``"Type: message"`` of the cause, or null) and
``ending``: ``status``, ``time``, ``rank`` (the rank it names, or null), ``ranks`` (all it
names), ``cause`` (one line), ``exception`` (the type's name), ``traceback``, ``signal``
(``"SIGKILL"``), ``step``, ``recorded_by`` (who wrote it: ``"rank 0"``, ``"the launcher"``,
``"the stall watchdog on rank 0"``) and ``lost_peer`` (true when all that was known was a
survivor's broken connection). The same ending is one line of ``events.jsonl``.

Who writes it: rank 0 at the end of ``fit`` (a worker's error reaches it through the job's
store, :func:`publish_failure`, or the launcher's per-rank error files); the stall watchdog's
rank that found the stall; the launcher when the workers cannot (``Trainer(devices=N)``'s
rank 0 for a SIGKILLed worker, ``meshtrain run``'s agent, which reads every rank's error file
and the exit codes). An ending is written once: a later one replaces it only where the first
knew no more than a lost connection (:func:`record_ending`). Each writer of an ending that is
not ``finished`` also writes ``report.html`` when the run's ``report`` setting is on.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import traceback
from pathlib import Path

from meshtrain.observe import run_files

STATUSES = ("running", "finished", "preempted", "failed", "stopped_by_watchdog", "killed")
RUN_DIR_FILE_ENV = "MESHTRAIN_RUN_DIR_FILE"  # where rank 0 tells `meshtrain run` its run folder
FAILURES_KEY = "meshtrain/failures"  # store: "r," per rank that published its failure
FAILURE_KEY = "meshtrain/failure/rank{}"
WAIT_FOR_CAUSE_S = 2.0  # how long rank 0 of Trainer(devices=N) waits for a worker's exit code
WAIT_FOR_STORE_S = 0.2  # (a rank puts its failure in the store before it dies: at once)
STORE_TIMEOUT_S = 5.0  # a failing rank's store calls wait no longer than this

_lock = threading.Lock()
_announced: dict = {"run_dir": None}  # this process's run folder, once announced


def announce(run_dir) -> None:
    """This process (rank 0) writes ``run_dir``: remembered for the launcher threads of this
    process, and written to ``$MESHTRAIN_RUN_DIR_FILE`` for an agent (``meshtrain run``)."""
    _announced["run_dir"] = Path(run_dir)
    path = os.environ.get(RUN_DIR_FILE_ENV)
    if path:
        try:
            run_files.write_json(Path(path), {"run_dir": str(run_dir)})
        except OSError:
            pass  # the agent's folder is gone: it will not record the ending


def announced() -> Path | None:
    """The run folder this process announced, or None."""
    return _announced["run_dir"]


def read_announcement(path) -> Path | None:
    """The run folder :func:`announce` wrote to ``path`` (the agent's side), or None."""
    data = run_files.read_json(Path(path)) if path else None
    return Path(data["run_dir"]) if data and data.get("run_dir") else None


def _replaceable(environment: dict) -> bool:
    current = environment.get("ending")
    if environment.get("status") in (None, "running") or not isinstance(current, dict):
        return True
    return bool(current.get("lost_peer"))


def record_ending(run_dir, status: str, *, rank: int | None = None, ranks=None,
                  cause: str | None = None, exception: str | None = None,
                  traceback_text: str | None = None, signal_name: str | None = None,
                  step: int | None = None, recorded_by: str = "rank 0",
                  lost_peer: bool = False, event_kind: str | None = None,
                  path=None, report: bool | None = None) -> bool:
    """Write the run's ending (see the module's doc); False when an ending that knew more was
    there already, or the run folder is gone. ``report``: write report.html too (None: when
    the ending is not ``finished`` and the run's ``report`` setting is on)."""
    assert status in STATUSES and status != "running", status
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return False
    ranks = list(ranks) if ranks is not None else ([] if rank is None else [rank])
    ending = {"status": status, "time": run_files.now(), "rank": rank, "ranks": ranks,
              "cause": cause, "exception": exception, "traceback": traceback_text,
              "signal": signal_name, "step": step, "recorded_by": recorded_by,
              "lost_peer": bool(lost_peer)}
    with _lock:
        environment = run_files.read_json(run_dir / run_files.ENVIRONMENT) or {}
        if not _replaceable(environment):
            return False
        error = None
        if status != "finished" and cause:
            error = f"{exception}: {cause}" if exception and not cause.startswith(
                exception) else cause
        run_files.update_environment(run_dir, status=status, finished=ending["time"],
                                     error=error, ending=ending)
        if status != "finished":
            kind = event_kind or {"stopped_by_watchdog": "watchdog", "killed": "killed",
                                  "preempted": "preempted"}.get(status, "failure")
            who = f"rank {rank}: " if rank is not None else ""
            run_files.append_event(run_dir, kind, f"{status}: {who}{error or cause or ''}",
                                   step, path)
    if report is None:
        settings = environment.get("settings")
        report = status != "finished" and isinstance(settings, dict) and bool(
            settings.get("report"))
    if report:
        write_report_quietly(run_dir)
    return True


def write_report_quietly(run_dir) -> Path | None:
    """report.html of ``run_dir``, or None (a problem in the page must not hide the ending)."""
    try:
        from meshtrain.observe.report import write_report

        return write_report(run_dir)
    except Exception:  # noqa: BLE001
        return None


# -- a failure's cause --------------------------------------------------------------------------
def describe(error: BaseException, rank: int, step: int | None = None) -> dict:
    """The ending one rank's ``error`` makes (keyword arguments of :func:`record_ending`)."""
    from meshtrain.launch.endings import error_line, lost_peer

    if isinstance(error, KeyboardInterrupt):
        return {"status": "killed", "rank": rank, "cause": "interrupted (Ctrl-C or SIGINT)",
                "exception": "KeyboardInterrupt", "signal_name": "SIGINT", "step": step}
    cause = str(error).strip() or error_line(error)
    return {"status": "failed", "rank": rank, "cause": cause,
            "exception": type(error).__name__, "step": step,
            "traceback_text": "".join(traceback.format_exception(error)),
            "lost_peer": lost_peer(error),
            "event_kind": "desync" if type(error).__name__ == "CollectiveMismatch" else None}


def _store():
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        try:
            return dist.distributed_c10d._get_default_store()
        except Exception:  # noqa: BLE001
            return None
    return None


def publish_failure(error: BaseException, rank: int, step: int | None = None) -> None:
    """Put this rank's failure in the job's store, for rank 0 to name it (best effort; a lost
    connection tells rank 0 nothing, and is left out)."""
    store = _store()
    info = describe(error, rank, step)
    if store is None or info.get("lost_peer"):
        return
    info["time"] = time.time()
    try:
        from datetime import timedelta

        store.set_timeout(timedelta(seconds=STORE_TIMEOUT_S))  # (its host may be stopped)
        store.set(FAILURE_KEY.format(rank), json.dumps(info))
        store.append(FAILURES_KEY, f"{rank},")
    except Exception:  # noqa: BLE001 - the store's host is gone: rank 0 cannot be told
        pass


def published_failures(store) -> list[dict]:
    """The failures the ranks put in ``store`` so far (earliest first)."""
    try:
        if not store.check([FAILURES_KEY]):
            return []
        ranks = {int(r) for r in store.get(FAILURES_KEY).decode().split(",") if r.strip()}
        found = [json.loads(store.get(FAILURE_KEY.format(r)).decode()) for r in sorted(ranks)]
    except Exception:  # noqa: BLE001
        return []
    return sorted(found, key=lambda f: f.get("time", 0.0))


def from_failure(first, recorded_by: str) -> dict:
    """The ending a launcher's :class:`~meshtrain.launch.endings.Failure` makes."""
    record = first.record
    if getattr(first, "stall", None):
        return {"status": "stopped_by_watchdog", "rank": first.rank, "cause": first.stall,
                "recorded_by": recorded_by}
    if record is not None:
        message = record["message"]
        exception, _, cause = message.partition(": ")
        return {"status": "failed", "rank": first.rank, "cause": cause or message,
                "exception": exception if cause else None,
                "traceback_text": record.get("traceback"), "recorded_by": recorded_by,
                "lost_peer": record["lost_peer"]}
    if first.exitcode < 0:
        name = _signal_name(-first.exitcode)
        return {"status": "killed", "rank": first.rank, "signal_name": name,
                "cause": f"killed by signal {name}{first.what()}", "recorded_by": recorded_by}
    return {"status": "failed", "rank": first.rank, "recorded_by": recorded_by,
            "cause": f"exited with code {first.exitcode} without a Python error"}


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def failure_ending(error: BaseException, rank: int, step: int | None = None, *,
                   workers=None, wait_s: float = WAIT_FOR_CAUSE_S) -> dict:
    """(Rank 0.) The ending of a run that ``error`` ended here: this rank's own error, or,
    when it only lost a peer, the first failure of another rank: what the ranks put in the
    store, else (``Trainer(devices=N)``, ``workers``) the workers' error files and exit codes,
    waiting up to ``wait_s`` for one to show. Under an agent (``meshtrain run``) it does not
    wait: the agent stops this rank soon, and records what the exit codes say."""
    from meshtrain.launch.endings import first_failure

    own = describe(error, rank, step)
    if not own.get("lost_peer"):
        return own
    store = _store()
    deadline = time.monotonic() + (wait_s if workers is not None else WAIT_FOR_STORE_S)
    while True:
        real = [f for f in (published_failures(store) if store is not None else [])
                if not f.get("lost_peer")]
        if real:
            found = real[0]
            found.pop("time", None)
            return {**found, "step": found.get("step", step)}
        first = first_failure(workers.failures()) if workers is not None else None
        if first is not None and not (first.record is not None and first.record["lost_peer"]):
            return {**from_failure(first, "rank 0"), "step": step}
        if time.monotonic() > deadline:
            return own
        time.sleep(0.1)


# -- the agent's side (`meshtrain run`) ----------------------------------------------------------
def record_agent_ending(err, run_dir_file) -> None:
    """After torchrun's ``ChildFailedError`` ``err``: the run's ending from every local
    worker's exit code and error file (the first failure, launch/endings.py), written into the
    run folder rank 0 announced, with the report, unless a worker recorded more already."""
    from meshtrain.launch.endings import Failure, first_failure, read_record

    run_dir = read_announcement(run_dir_file)
    if run_dir is None:
        return  # rank 0 is not on this node, or never started its run
    failures = [Failure(rank, f.exitcode, read_record(f.error_file),
                        stopped=f.exitcode == -signal.SIGTERM)  # torchrun stops with it
                for rank, f in err.failures.items()]
    first = first_failure(failures)
    if first is not None:
        record_ending(run_dir, **from_failure(first, "the launcher (meshtrain run)"))


def record_interrupted(run_dir_file, signal_number: int) -> None:
    """The launcher got ``signal_number`` (SIGTERM, SIGINT) and stopped the workers."""
    run_dir = read_announcement(run_dir_file)
    if run_dir is not None:
        name = _signal_name(signal_number)
        record_ending(run_dir, "killed", signal_name=name, recorded_by="the launcher "
                      "(meshtrain run)", cause=f"the launcher got {name} and stopped the workers")
