"""Each named fault point (MESHTRAIN_FAULT, meshtrain/fault/inject.py) on 2 ranks: the rank dies
there, the job is started again as `meshtrain run --max-restarts` starts it (the same command
with TORCHELASTIC_RESTART_COUNT=1, so a first-attempt fault does not fire again), resumes from
the last complete checkpoint and ends with model and optimizer state bit for bit those of a
fault-free run. A stopped (SIGSTOP) rank ends the job instead, non-zero.

One fault-free run per job (ep=2 MoE GPT: gradients, checkpoint, MoE, optimizer; pp=2 GPT:
pipeline), shared by the points. Restarts through `meshtrain run` itself, and a failure that
repeats stopping them: test_restart_guards.py."""

import time
from pathlib import Path

import pytest
import torch
from points_job import train

from meshtrain.checkpoint.safe_load import load_dcp_keys
from meshtrain.errors import WorkerFailed
from meshtrain.launch.spawn import run_workers

JOBS = {"moe": ["--layout", "ep=2", "--model", "moe"], "pipeline": ["--layout", "pp=2",
                                                                    "--model", "gpt"]}
STEPS = ["--max-steps", "6", "--ckpt-every", "2"]
# (MESHTRAIN_FAULT, job, the step the restarted job resumes from)
POINTS = [("gradient_allreduce:5:1:kill", "moe", 4),
          ("checkpoint_shard:4:1:kill", "moe", 2),  # rank 1 dies in the save of step 4
          ("moe_all_to_all:5:0:kill", "moe", 4),
          ("optimizer_step:5:1:kill", "moe", 4),
          ("pipeline_p2p:5:1:kill", "pipeline", 4)]


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory):
    """job -> the final state of its fault-free run (run once, when a test first needs it)."""
    done = {}

    def final_state(job):
        if job not in done:
            run_dir = tmp_path_factory.mktemp(f"fault_free_{job}")
            run_workers(train, 2, (["--run-dir", str(run_dir), *JOBS[job], *STEPS],),
                        timeout=150)
            done[job] = load_dcp_keys(run_dir / "checkpoints" / "final", {"model", "optim"})
        return done[job]

    return final_state


def _tensors(state, prefix=""):
    if isinstance(state, torch.Tensor):
        yield prefix, state
    elif isinstance(state, dict):
        for key, value in state.items():
            yield from _tensors(value, f"{prefix}.{key}")
    elif isinstance(state, (list, tuple)):
        for i, value in enumerate(state):
            yield from _tensors(value, f"{prefix}.{i}")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("spec,job,resumed_at", POINTS, ids=[p[0].split(":")[0] for p in POINTS])
def test_a_fault_at_each_point_restarts_to_the_fault_free_result(
        fault_free, tmp_path, monkeypatch, spec, job, resumed_at):
    expected = fault_free(job)
    args = (["--run-dir", str(tmp_path), *JOBS[job], *STEPS],)
    monkeypatch.setenv("MESHTRAIN_FAULT", spec)
    with pytest.raises(WorkerFailed):
        run_workers(train, 2, args, timeout=150)
    point, step = spec.split(":")[:2]
    if point == "checkpoint_shard":  # died after writing its shard, before the commit
        partial = tmp_path / "checkpoints" / f".tmp-step_{int(step):08d}"
        assert (partial / "__1_0.distcp").is_file() and not (partial / ".metadata").exists()
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # the restart (what torchrun sets)
    run_workers(train, 2, args, timeout=150)
    assert (tmp_path / "attempts" / "rank1_attempt1").read_text() == str(resumed_at)
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))
    got = dict(_tensors(load_dcp_keys(tmp_path / "checkpoints" / "final", {"model", "optim"})))
    want = dict(_tensors(expected))
    assert got.keys() == want.keys() and len(want) > 10
    for name, value in want.items():
        assert torch.equal(got[name], value), name


@pytest.mark.timeout(120)
def test_a_stopped_rank_ends_the_job_non_zero(tmp_path, monkeypatch):
    # rank 1 is frozen (SIGSTOP) at the start of step 3; rank 0's watchdog ends the job
    # (which rank it names is the watchdog's: tests/fault/test_watchdog.py)
    monkeypatch.setenv("MESHTRAIN_FAULT", "step_start:3:1:stop")
    start = time.monotonic()
    with pytest.raises(WorkerFailed) as failure:
        run_workers(train, 2, (["--run-dir", str(tmp_path), "--layout", "dp=2",
                                "--stall-timeout", "3", "--collective-timeout", "20"],),
                    timeout=100)
    assert time.monotonic() - start < 60, "the job should end soon after the stall timeout"
    assert "exited with code" in str(failure.value) or "raised" in str(failure.value)
    assert Path(tmp_path, "attempts", "rank1_attempt0").is_file()
