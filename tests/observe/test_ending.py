"""How a run's ending is recorded (meshtrain/observe/ending.py) whoever writes it: a later
writer replaces an ending only where the first knew no more than a lost connection; `meshtrain
run`'s agent records what its workers' exit codes and error files say, and removes a log folder
it made that holds nothing. In-process: made-up failures, no workers."""

import json
import os
import signal
from types import SimpleNamespace

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from meshtrain.launch import agent_ending, endings
from meshtrain.observe import ending, run_files


def _run(tmp_path, **settings):
    run_files.update_environment(tmp_path, status="running", ending=None,
                                 settings={"report": False, **settings})
    return tmp_path


def _environment(run_dir) -> dict:
    return json.loads((run_dir / "environment.json").read_text())


def test_a_lost_connection_is_replaced_by_the_cause_and_a_cause_is_kept(tmp_path):
    run = _run(tmp_path)
    lost = ending.describe(RuntimeError("[pair.cc:553] Connection reset by peer"), 0)
    assert lost["lost_peer"] and ending.record_ending(run, **lost)
    assert _environment(run)["status"] == "failed"
    killed = {"status": "killed", "rank": 1, "signal_name": "SIGKILL", "cause": "killed by "
              "signal SIGKILL", "recorded_by": "the launcher (meshtrain run)"}
    assert ending.record_ending(run, **killed)
    environment = _environment(run)
    assert (environment["status"], environment["ending"]["rank"]) == ("killed", 1)
    assert environment["error"] == "killed by signal SIGKILL"
    # a real cause is not replaced by what another writer saw later
    assert not ending.record_ending(run, **ending.describe(ValueError("late"), 0))
    assert _environment(run)["ending"]["signal"] == "SIGKILL"
    kinds = [(e["kind"], e["message"]) for e in run_files.read_events(run)]
    assert kinds == [("failure", "failed: rank 0: RuntimeError: [pair.cc:553] Connection reset "
                                 "by peer"),
                     ("killed", "killed: rank 1: killed by signal SIGKILL")]


def test_an_error_records_its_type_and_traceback(tmp_path):
    try:
        raise ValueError("bad batch")
    except ValueError as error:
        described = ending.describe(error, 1, step=7)
    assert ending.record_ending(_run(tmp_path), **described)
    environment = _environment(tmp_path)
    assert environment["error"] == "ValueError: bad batch"
    found = environment["ending"]
    assert (found["rank"], found["step"], found["exception"]) == (1, 7, "ValueError")
    assert "in test_an_error_records_its_type_and_traceback" in found["traceback"]


def _failures(tmp_path, *ranks):
    """torchrun's ChildFailedError for (rank, exit code, error) triples."""
    failures = {}
    for rank, code, error in ranks:
        path = tmp_path / f"error{rank}.json"
        if error is not None:
            os.environ[endings.TORCHRUN_ERROR_FILE_ENV] = str(path)
            try:
                endings.record_failure(error, shown="traceback")
            finally:
                del os.environ[endings.TORCHRUN_ERROR_FILE_ENV]
        failures[rank] = ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=code,
                                        error_file=str(path))
    return ChildFailedError("job", failures)


@pytest.mark.parametrize("case", ["raise", "kill"])
def test_the_agent_records_the_first_failure_and_the_report(tmp_path, case):
    (tmp_path / "run").mkdir()
    run = _run(tmp_path / "run", report=True)
    logs = tmp_path / "logs"
    (logs / "job_x" / "attempt_0" / "0").mkdir(parents=True)
    args = SimpleNamespace(log_dir=str(logs), meshtrain_temp_log_dir=True)
    lost = RuntimeError("Connection closed by peer")
    if case == "raise":
        err = _failures(tmp_path, (0, 1, lost), (1, 1, ValueError("rank 1 failed")))
    else:
        err = _failures(tmp_path, (0, -signal.SIGTERM, None), (1, -signal.SIGKILL, None))
    with pytest.raises(ChildFailedError), agent_ending.agent_records(args):
        ending.announce(run)  # rank 0's side: into the file the agent named
        raise err
    environment = _environment(run)
    assert environment["ending"]["rank"] == 1, environment
    assert environment["ending"]["recorded_by"] == "the launcher (meshtrain run)"
    if case == "raise":
        assert environment["status"] == "failed"
        assert environment["error"] == "ValueError: rank 1 failed"
    else:
        assert environment["status"] == "killed"
        assert environment["ending"]["signal"] == "SIGKILL"
    assert "rank 1" in (run / "report.html").read_text()
    assert logs.is_dir()  # a failure keeps the error files the summary points to
    assert ending.RUN_DIR_FILE_ENV not in os.environ


def test_the_agent_removes_its_own_empty_log_folder_after_a_success(tmp_path):
    for restarted, kept in ((False, False), (True, True)):
        logs = tmp_path / f"logs{restarted}"
        (logs / "job_x" / "attempt_0" / "0").mkdir(parents=True)
        if restarted:  # the restart message points at the failed attempt's error file
            (logs / "job_x" / "attempt_1" / "0").mkdir(parents=True)
        with agent_ending.agent_records(SimpleNamespace(log_dir=str(logs),
                                                   meshtrain_temp_log_dir=True)):
            path = os.environ[ending.RUN_DIR_FILE_ENV]
        assert logs.is_dir() == kept and not os.path.exists(path)
    given = tmp_path / "given"  # one the user named stays
    (given / "job_x" / "attempt_0").mkdir(parents=True)
    with agent_ending.agent_records(SimpleNamespace(log_dir=str(given))):
        pass
    assert given.is_dir()


def test_a_launcher_names_the_rank_the_watchdog_found_not_the_one_that_found_it(tmp_path):
    os.environ[endings.TORCHRUN_ERROR_FILE_ENV] = str(tmp_path / "error0.json")
    try:  # rank 0 found the stall and recorded the finding; rank 1 (stopped) recorded nothing
        endings.record_stall("step 4 stalled: rank 1 did not answer", [1])
    finally:
        del os.environ[endings.TORCHRUN_ERROR_FILE_ENV]
    record = endings.read_record(tmp_path / "error0.json")
    failures = [endings.Failure(0, 3, record),
                endings.Failure(1, -signal.SIGTERM, None, stopped=True)]
    first = endings.first_failure(failures)
    assert (first.rank, first.how()) == (1, "stalled")
    assert first.what() == ": step 4 stalled: rank 1 did not answer"
    assert ending.from_failure(first, "x")["status"] == "stopped_by_watchdog"
    # a launcher that does not see rank 1 (another node) names the rank that recorded it
    alone = endings.first_failure(failures[:1])
    assert (alone.rank, alone.how()) == (0, "was stopped by the stall watchdog")


def test_rank_0_names_the_error_a_worker_put_in_the_store(monkeypatch):
    import torch.distributed as dist

    store = dist.HashStore()
    monkeypatch.setattr(ending, "_store", lambda: store)
    lost = RuntimeError("Connection closed by peer")
    ending.publish_failure(lost, 2)  # a survivor's lost connection tells rank 0 nothing
    assert ending.published_failures(store) == []
    # nothing in the store: rank 0's own lost connection, marked so (a launcher may replace it)
    assert ending.failure_ending(lost, 0)["lost_peer"]
    try:
        raise ValueError("rank 1's batch")
    except ValueError as error:
        ending.publish_failure(error, 1, step=3)
    found = ending.failure_ending(lost, 0, step=3)
    assert (found["rank"], found["exception"], found["cause"]) == (1, "ValueError",
                                                                   "rank 1's batch")
    assert not found["lost_peer"] and "raise ValueError" in found["traceback_text"]


def test_an_interrupted_job_is_recorded_as_killed_with_the_signal(tmp_path):
    from torch.distributed.elastic.multiprocessing.api import SignalException

    run = _run(tmp_path)
    with pytest.raises(SignalException), agent_ending.agent_records(SimpleNamespace(log_dir=None)):
        ending.announce(run)
        raise SignalException("got SIGTERM", signal.SIGTERM)
    found = _environment(run)["ending"]
    assert (found["status"], found["signal"], found["rank"]) == ("killed", "SIGTERM", None)
    assert found["cause"] == "the launcher got SIGTERM and stopped the workers"
    # Ctrl-C in a rank (KeyboardInterrupt) is a kill too, not a failure
    assert ending.describe(KeyboardInterrupt(), 0)["status"] == "killed"
