"""Restarts that cannot help (meshtrain/fault/restarts.py, checkpoint/restarted.py): under
`meshtrain run --max-restarts 3` without checkpoints, a failure that repeats at the same step
stops the restarts after one, the restart says that it starts again from step 0 and continues
in the same run folder; a save the file system refuses on one rank is one error on every rank."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from points_job import train

from meshtrain.errors import WorkerFailed
from meshtrain.launch.spawn import run_workers

JOB = str(Path(__file__).with_name("points_job.py"))


@pytest.mark.timeout(150)
def test_a_repeated_failure_stops_restarts_and_a_restart_without_checkpoint_says_so(tmp_path):
    command = [sys.executable, "-m", "meshtrain", "run", "--nproc-per-node", "2",
               "--max-restarts", "3", JOB, "--root-dir", str(tmp_path), "--name", "job",
               "--layout", "dp=2", "--max-steps", "6"]
    env = dict(os.environ, OMP_NUM_THREADS="1",  # a bug in every attempt: rank 1, step 3
               MESHTRAIN_FAULT="optimizer_step:3:1:raise:all")
    done = subprocess.run(command, capture_output=True, text=True, timeout=140, env=env)
    output = done.stdout + done.stderr
    assert done.returncode != 0, output
    assert "--max-restarts 3 without periodic checkpoints: a restart starts again from step 0" \
        in output
    # one run folder, continued by the restart from step 0, the lost rows dropped
    (run_dir,) = (tmp_path / "job").iterdir()
    assert f"restart 1 of this job: {run_dir} holds no checkpoint to resume from, so training " \
           "starts again from step 0 there and what the earlier attempt trained is lost (2 " \
           "metrics.csv row(s) of it dropped)" in output
    started = sorted(p.name for p in (run_dir / "attempts").iterdir())
    assert started == ["rank0_attempt0", "rank0_attempt1", "rank1_attempt0", "rank1_attempt1"]
    assert "meshtrain run: not restarting again (2 of --max-restarts 3 left): rank 1 failed at " \
           "step 3 with InjectedFault: 'injected fault at optimizer_step (step 3, rank 1)', as " \
           "in the attempt before" in output
    assert "restarted once after a failure" in output
    steps = [line.split(",")[0] for line in (run_dir / "metrics.csv").read_text().splitlines()]
    assert steps[1:] == ["1", "2"], steps  # each step once: attempt 1's


@pytest.mark.timeout(120)
def test_a_write_refused_on_one_rank_is_one_error_on_every_rank(tmp_path, monkeypatch):
    monkeypatch.setenv("MESHTRAIN_FAULT", "checkpoint_shard:4:1:eacces")
    with pytest.raises(WorkerFailed) as failed:
        run_workers(train, 2, (["--run-dir", str(tmp_path), "--layout", "dp=2",
                                "--ckpt-every", "2"],), timeout=100)
    text = str(failed.value)
    where = tmp_path / "checkpoints" / ".tmp-step_00000004"
    line = (f"CheckpointWriteError: the checkpoint of step 4 could not be written to {where}: the "
            "file system refused this user's writes (rank 1: PermissionError: [Errno 13]")
    assert text.count(line) == 2, text  # rank 0 and rank 1 alike
    assert "step_00000002, is kept" in text
    assert not where.exists() and (tmp_path / "checkpoints" / "step_00000002").is_dir()
