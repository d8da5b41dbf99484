"""A parameter-server worker killed mid-run under `meshtrain run --max-restarts 1`: every
process (servers too) restarts, worker 0 sends the latest checkpoint to the new servers, and the
job ends where one process that never stopped ends."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from fault_job import mlp, train
from records import assert_equal_weights, attempts, final_weights, steps

JOB = str(Path(__file__).with_name("fault_job.py"))
STEPS, EVERY = 8, 2


@pytest.mark.timeout(300)
def test_a_killed_ps_worker_restarts_resumes_and_finishes(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    reference = tmp_path / "one_process"
    train(["--run-dir", str(reference), "--max-steps", str(STEPS)])
    run_dir = tmp_path / "ps"
    command = [sys.executable, "-m", "meshtrain", "run", "--nproc-per-node", "3",
               "--max-restarts", "1", JOB, "--run-dir", str(run_dir), "--layout", "ps=1,dp=2",
               "--max-steps", str(STEPS), "--ckpt-every", str(EVERY), "--fault", "kill",
               "--fault-step", "5", "--fault-rank", "1"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=280,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert "resumed from" in output and "step_00000004" in output, output[-4000:]
    started = attempts(run_dir)  # the workers' second attempt began at the checkpoint
    assert started["rank0_attempt1"] == started["rank1_attempt1"] == 4, started
    assert "rank2_attempt0" not in started  # the server ran no training loop
    history, expected = steps(run_dir), steps(reference)
    assert {s: r["samples"] for s, r in history.items()} == {
        s: r["samples"] for s, r in expected.items()}
    assert_equal_weights(final_weights(run_dir, mlp), final_weights(reference, mlp), atol=1e-5)
