"""Any failure on any rank ends the job with a non-zero exit, and the message names the rank
that failed first with its real error: ``meshtrain train``, ``meshtrain run`` and a plain
``python script.py`` (Trainer(devices=2)), each with a refusal inside the ranks (a ConfigError
on every rank after start), rank 1's model raising at step 2, and rank 1 SIGKILLed at step 2
(tests/launch/failing_job.py). One subprocess per pair, each entry point ending a job its own
way (rank 0's atexit, the command line's exit code 2, torchrun's agent), but for ``python`` with
a rank 1 raising: tests/launch/test_script_workers.py runs that one. The runs that raise or
are killed also check the run folder's record of the ending (environment.json's status and
ending, events.jsonl, report.html: observe/ending.py), whoever wrote it: rank 0 (``python``,
``train``) or the agent (``run``)."""

import html
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import script_env

HERE = Path(__file__).resolve().parent
TIMEOUT = 150

CONFIG = """
[job]
recipe = "failing_job"
[trainer]
layout = "dp=2"
devices = 2
accelerator = "cpu"
max_steps = 3
global_batch_size = 16
[checkpoint]
save_final_checkpoint = false
[logging]
loggers = []
progress_bar = false
model_summary = false
report = false
"""


def _run(entry: str, kind: str, tmp_path: Path) -> subprocess.CompletedProcess:
    run_dir = tmp_path / "run"
    report = _reports(entry, kind)
    if entry == "python":
        command = [str(HERE / "failing_job.py"), kind, str(run_dir)]
    elif entry == "run":
        command = ["-m", "meshtrain", "run", "--nproc-per-node", "2",
                   str(HERE / "failing_job.py"), kind, str(run_dir)]
    else:
        # the report only where the ending is checked (it takes a second or two)
        (tmp_path / "job.toml").write_text(CONFIG.replace(
            "report = false", f"report = {str(report).lower()}"))
        command = ["-m", "meshtrain", "train", "job.toml", f"--failure.kind={kind}",
                   f"--logging.run_dir={run_dir}"]
    env = script_env()
    env["PYTHONPATH"] += os.pathsep + str(HERE)  # the recipe failing_job
    env["FAILING_JOB_REPORT"] = str(int(report))
    try:
        return subprocess.run([sys.executable, *command], env=env, cwd=tmp_path, text=True,
                              capture_output=True, timeout=TIMEOUT)
    finally:  # (rank 1 runs in a session of its own: never leave it behind)
        for pid_file in (tmp_path / "pids").glob("*.pid"):
            try:
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass


def _last_lines(text: str) -> str:
    return "\n".join(text.strip().splitlines()[-3:])


def _reports(entry: str, kind: str) -> bool:
    """Whether the run writes its report (it takes a second or two): where its ending is
    checked, but for ``run`` with rank 1 raising, where rank 0's lost connection must fail it
    before torchrun's agent stops it (the order the summary checks)."""
    return kind in ("kill", "stop") or (kind == "raise" and entry != "run")


def _recorded_ending(tmp_path: Path, status: str, kind: str, message: str,
                     report: bool = True) -> dict:
    """The run folder's ending: environment.json, the one event of ``kind`` that says the
    same, and the report (written by whoever recorded the ending); returns environment.json's
    ``ending``."""
    run = tmp_path / "run"
    environment = json.loads((run / "environment.json").read_text())
    ending = environment["ending"]
    assert environment["status"] == ending["status"] == status, environment
    assert ending["rank"] == 1 and environment["finished"] == ending["time"], ending
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    found = [e for e in events if e["kind"] == kind]
    assert len(found) == 1 and f"{status}: rank 1: {message}" in found[0]["message"], events
    if report:
        page = html.unescape((run / "report.html").read_text())
        assert f'status-{status}">{status}</span>' in page, page[:3000]
        assert f"rank 1: {message}" in page, page[:3000]
    return ending


ENTRIES = ("python", "run", "train")


@pytest.mark.timeout(TIMEOUT + 30)
@pytest.mark.parametrize("entry", ENTRIES)
def test_a_refusal_inside_the_ranks_fails_the_job(entry, tmp_path):
    done = _run(entry, "refuse", tmp_path)
    err = done.stderr
    # the command line exits 2 after a refusal, as it does before start; a script 1
    assert done.returncode == (2 if entry == "train" else 1), err
    assert "TRAINED" not in done.stdout
    refusal = "ConfigError: this job refuses its data after start"
    if entry == "train":  # the message, as any refusal of the command line
        assert "meshtrain: error: this job refuses its data after start" in err
        assert "WorkerFailed" not in err and "Traceback" not in err.split("[rank1]")[0], err
    elif entry == "python":  # rank 0's own refusal, not blamed on rank 1
        assert refusal in _last_lines(err) and "WorkerFailed" not in err, err
    else:  # every rank refused by itself: the first one's error, and where it is (the other
        # exits by itself, or, on a busy machine, torchrun stops it first: 1 in 3 runs here)
        summary = _last_lines(err)
        assert "meshtrain run: the job failed: rank " in summary, err
        assert re.search(r"exited with code 1 first( \(1 more worker\(s\) failed after it\))?: "
                         + re.escape(refusal), summary) and "error.json" in summary, err


@pytest.mark.timeout(TIMEOUT + 30)
@pytest.mark.parametrize("entry", ("run", "train"))  # python: test_script_workers.py
def test_a_model_raising_on_rank_1_fails_the_job_and_is_named(entry, tmp_path):
    done = _run(entry, "raise", tmp_path)
    err, summary = done.stderr, _last_lines(done.stderr)
    assert done.returncode == 1, err
    error = "ValueError: rank 1's model raised at step 2 (made up)"
    assert err.index("Traceback") < err.index(error), err  # rank 1's own traceback...
    if entry == "run":  # ... and rank 1 named first, though rank 0 failed within the second
        # (or was stopped by torchrun before it could, on a busy machine)
        assert "meshtrain run: the job failed: rank 1 (local rank 1" in summary, err
        assert re.search(r"exited with code 1 first( \(1 more worker\(s\) failed after it\))?: "
                         + re.escape(f"{error} (its traceback is in the report above and in "),
                         summary), err
    else:  # ... and rank 0's lost connection laid at rank 1's door
        assert (f"WorkerFailed: worker rank 1 exited with code 1 first: {error} (its traceback "
                "is above)") in summary, err
    # the run's recorded error is rank 1's, with its traceback, not rank 0's lost connection
    ending = _recorded_ending(tmp_path, "failed", "failure", error, _reports(entry, "raise"))
    assert ending["exception"] == "ValueError" and ending["lost_peer"] is False, ending
    assert 'in forward\n    raise ValueError("rank 1\'s model raised' in ending["traceback"], ending
    # rank 0 read it from the store (rank 1 put it there) or the error files; under `run` the
    # agent writes it from the error files when rank 0 was stopped first
    assert ending["recorded_by"] in ("rank 0", "the launcher (meshtrain run)")[
        :2 if entry == "run" else 1], ending


@pytest.mark.timeout(TIMEOUT + 30)
@pytest.mark.parametrize("entry", ENTRIES)
def test_a_sigkilled_rank_fails_the_job_and_no_traceback_is_promised(entry, tmp_path):
    done = _run(entry, "kill", tmp_path)
    err, summary = done.stderr, _last_lines(done.stderr)
    assert done.returncode == 1, err
    killed = ("was killed by signal SIGKILL first; it printed no error: SIGKILL comes from "
              "outside the job")
    if entry == "run":  # rank 0 fails on its lost peer, or (writing its report) is stopped
        assert "rank 1 (local rank 1" in summary and (killed.replace(
            " first;", " first (1 more worker(s) failed after it);") in summary
            or killed in summary), err
    else:
        assert f"WorkerFailed: worker rank 1 {killed}" in summary, err
    assert "traceback is above" not in err and "its traceback is in" not in summary, err
    ending = _recorded_ending(tmp_path, "killed", "killed", "killed by signal SIGKILL; it "
                              "printed no error")
    assert ending["signal"] == "SIGKILL" and ending["traceback"] is None, ending
    # under `run` only the agent sees the SIGKILL (rank 0 saw a lost connection)
    assert ending["recorded_by"] == "the launcher (meshtrain run)" if entry == "run" else \
        ending["recorded_by"] in ("rank 0", "the launcher (rank 0's process)"), ending


@pytest.mark.timeout(TIMEOUT + 30)
def test_a_stopped_rank_is_named_by_the_stall_watchdog_and_ended(tmp_path):
    """Rank 1 SIGSTOPped at step 2 under `python script.py`: rank 0 (its launcher) names it,
    records the ending, writes the report, and ends the stopped process before it exits 3."""
    done = _run("python", "stop", tmp_path)
    err = done.stderr
    assert done.returncode == 3, err  # the watchdog's code, not a lost connection's 1
    stopped = ("rank 1 did not answer: its process (pid {}) is stopped (state T in "
               "/proc/{}/status: SIGSTOP or job control), so it cannot run Python")
    pids = {int(p.read_text()) for p in (tmp_path / "pids").glob("*.pid")}
    named = [pid for pid in pids if stopped.format(pid, pid) in err]
    assert len(named) == 1, err[-3000:]
    assert "(limit 2 s, found by rank 0)" in err and "WorkerFailed" not in err, err[-3000:]
    ending = _recorded_ending(tmp_path, "stopped_by_watchdog", "watchdog",
                              "step 2 stalled for ", report=True)
    assert stopped.format(*named * 2) in ending["cause"] and ending["ranks"] == [1], ending
    # the stopped rank did not outlive the job (the test's finally would have killed it)
    assert _gone(named[0]), Path(f"/proc/{named[0]}/status").read_text()


def _gone(pid: int) -> bool:
    """The process has ended (a zombie that nothing has reaped yet counts as ended)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    return "State:\tZ" in status
