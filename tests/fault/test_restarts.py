"""A worker killed mid-run (or mid-save) under `meshtrain run --max-restarts 1`: the job restarts,
resumes from the latest complete checkpoint and ends exactly where an uninterrupted run ends."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from records import assert_equal_weights, attempts, checkpoints_are_finite, final_weights, steps
from fault_job import mlp

from meshtrain.observe.loggers import read_metrics_csv
from meshtrain.observe.run_files import read_breakdown

JOB = str(Path(__file__).with_name("fault_job.py"))
STEPS, EVERY = 8, 2


def meshtrain_run(run_dir, *job_args, max_restarts=1, timeout=150):
    command = [sys.executable, "-m", "meshtrain", "run", "--nproc-per-node", "2",
               "--max-restarts", str(max_restarts), JOB, "--run-dir", str(run_dir),
               "--layout", "dp=2", "--max-steps", str(STEPS), "--ckpt-every", str(EVERY),
               *job_args]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    return done.returncode, done.stdout + done.stderr


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    code, output = meshtrain_run(run_dir, max_restarts=0)
    assert code == 0, output
    return run_dir


def _check_same_run(run_dir, reference, resumed_at):
    # the second attempt started from the checkpoint, on both ranks
    started = attempts(run_dir)
    assert started["rank0_attempt1"] == started["rank1_attempt1"] == resumed_at, started
    # fp32 dp on CPU: bit for bit the uninterrupted run
    assert_equal_weights(final_weights(run_dir, mlp), final_weights(reference, mlp))
    # the same global samples at every step, none repeated or skipped
    history, expected = steps(run_dir), steps(reference)
    assert {s: r["samples"] for s, r in history.items()} == {
        s: r["samples"] for s, r in expected.items()}
    checkpoints_are_finite(run_dir, mlp)
    assert not list((Path(run_dir) / "checkpoints").glob(".tmp-*"))
    # the per-step files hold each step once, as the uninterrupted run's do: the rows an attempt
    # logged past the checkpoint it was resumed from were dropped (and logged again)
    logged = [(r["step"], r["train/loss"]) for r in read_metrics_csv(Path(run_dir, "metrics.csv"))]
    assert logged == [(r["step"], r["train/loss"])
                      for r in read_metrics_csv(Path(reference, "metrics.csv"))], logged
    assert [(r["step"], r["rank"]) for r in read_breakdown(run_dir)] == [
        (r["step"], r["rank"]) for r in read_breakdown(reference)]


@pytest.mark.timeout(240)
def test_sigkill_at_a_step_restarts_and_matches_the_uninterrupted_run(uninterrupted, tmp_path):
    code, output = meshtrain_run(tmp_path, "--fault", "kill", "--fault-step", "5")
    assert code == 0, output
    assert "resumed from" in output and "step_00000004" in output
    assert "resume=None (--checkpoint.resume=none) starts a new run instead" in output
    _check_same_run(tmp_path, uninterrupted, resumed_at=4)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_kill_during_a_checkpoint_write_resumes_from_the_previous_one(
        uninterrupted, tmp_path, mode):
    extra = ["--async-ckpt"] if mode == "async" else []
    code, output = meshtrain_run(tmp_path, "--fault", "kill-in-save", "--fault-step", "4",
                                 *extra)
    assert code == 0, output
    # the interrupted save of step 4 was never committed: attempt 1 resumed from step 2
    _check_same_run(tmp_path, uninterrupted, resumed_at=2)
