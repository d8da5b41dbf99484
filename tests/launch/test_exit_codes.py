"""Any failure on any rank ends the job with a non-zero exit, and the message names the rank
that failed first with its real error: ``meshtrain train``, ``meshtrain run`` and a plain
``python script.py`` (Trainer(devices=2)), each with a refusal inside the ranks (a ConfigError
on every rank after start), rank 1's model raising at step 2, and rank 1 SIGKILLed at step 2
(tests/launch/failing_job.py). One subprocess per pair, each entry point ending a job its own
way (rank 0's atexit, the command line's exit code 2, torchrun's agent), but for ``python`` with
a rank 1 raising: tests/launch/test_script_workers.py runs that one."""

import os
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
    if entry == "python":
        command = [str(HERE / "failing_job.py"), kind, str(run_dir)]
    elif entry == "run":
        command = ["-m", "meshtrain", "run", "--nproc-per-node", "2",
                   str(HERE / "failing_job.py"), kind, str(run_dir)]
    else:
        (tmp_path / "job.toml").write_text(CONFIG)
        command = ["-m", "meshtrain", "train", "job.toml", f"--failure.kind={kind}",
                   f"--logging.run_dir={run_dir}"]
    env = script_env()
    env["PYTHONPATH"] += os.pathsep + str(HERE)  # the recipe failing_job
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
    else:  # every rank refused by itself: the first one's error, and where it is
        summary = _last_lines(err)
        assert "meshtrain run: the job failed: rank " in summary, err
        assert f"exited with code 1 first (1 more worker(s) failed after it): {refusal}" in \
            summary and "error.json" in summary, err


@pytest.mark.timeout(TIMEOUT + 30)
@pytest.mark.parametrize("entry", ("run", "train"))  # python: test_script_workers.py
def test_a_model_raising_on_rank_1_fails_the_job_and_is_named(entry, tmp_path):
    done = _run(entry, "raise", tmp_path)
    err, summary = done.stderr, _last_lines(done.stderr)
    assert done.returncode == 1, err
    error = "ValueError: rank 1's model raised at step 2 (made up)"
    assert err.index("Traceback") < err.index(error), err  # rank 1's own traceback...
    if entry == "run":  # ... and rank 1 named first, though rank 0 failed within the second
        assert "meshtrain run: the job failed: rank 1 (local rank 1" in summary, err
        assert f"exited with code 1 first (1 more worker(s) failed after it): {error} (its " \
            "traceback is in the report above and in " in summary, err
    else:  # ... and rank 0's lost connection laid at rank 1's door
        assert (f"WorkerFailed: worker rank 1 exited with code 1 first: {error} (its traceback "
                "is above)") in summary, err


@pytest.mark.timeout(TIMEOUT + 30)
@pytest.mark.parametrize("entry", ENTRIES)
def test_a_sigkilled_rank_fails_the_job_and_no_traceback_is_promised(entry, tmp_path):
    done = _run(entry, "kill", tmp_path)
    err, summary = done.stderr, _last_lines(done.stderr)
    assert done.returncode == 1, err
    killed = ("was killed by signal SIGKILL first; it printed no error: SIGKILL comes from "
              "outside the job")
    if entry == "run":
        assert "rank 1 (local rank 1" in summary and killed.replace(
            " first;", " first (1 more worker(s) failed after it);") in summary, err
    else:
        assert f"WorkerFailed: worker rank 1 {killed}" in summary, err
    assert "traceback is above" not in err and "its traceback is in" not in summary, err
