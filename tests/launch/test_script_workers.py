"""`Trainer(devices=2)` in a script started with plain `python script.py`: rank 0 starts rank 1 by
running the script again (ScriptWorkers). A success must match one process; a failure on either
rank must end the job with a non-zero exit, the traceback, and no hang."""

import json
import re
import subprocess
import textwrap

import pytest
import torch
from conftest import run_script
from parity import params_of, run_layout

TIMEOUT = 120

SCRIPT = """
import os, sys
from pathlib import Path

import torch
import torch.nn.functional as F
from parity import adamw, mlp, regression_data

from meshtrain import Trainer

pid_dir, fail_rank = Path(sys.argv[1]), int(sys.argv[2])
rank = int(os.environ.get("RANK", "0"))  # not set yet on rank 0, which starts the others
(pid_dir / f"{os.getpid()}.pid").write_text(str(os.getpid()))
calls = 0


def loss_fn(output, target):
    global calls
    calls += 1
    step = calls  # one micro-batch per step
    if int(os.environ["RANK"]) == fail_rank and step > 2:
        raise RuntimeError(f"boom on rank {fail_rank}")
    return F.mse_loss(output, target)


trainer = Trainer(devices=2, layout="dp=2", accelerator="cpu", max_steps=5, global_batch_size=16,
                  seed=0, loggers=(), progress_bar=False, save_final_checkpoint=False,
                  run_dir=pid_dir / "run")
model = trainer.fit(mlp, regression_data(), optimizer=adamw, loss_fn=loss_fn)
assert trainer.world_size == 2 and trainer.layout.batch_degree == 2
# every rank saves the whole trained state (DDP: each holds all of it)
state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
torch.save(state, pid_dir / f"state_rank{trainer.rank}.pt")
# one write per line (stdout may be unbuffered): the two ranks' lines never interleave
if trainer.is_global_zero:
    sys.stdout.write(f"SAVED RANK {trainer.rank}\\n")
else:
    sys.stdout.write(f"worker rank {trainer.rank} done\\n")
"""


def _run(tmp_path, fail_rank: int) -> subprocess.CompletedProcess:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT))
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    done = run_script(script, pid_dir, fail_rank, cwd=tmp_path, pid_dir=pid_dir,
                      timeout=TIMEOUT)
    return done


@pytest.mark.timeout(TIMEOUT + 30)
def test_devices_2_script_matches_one_process(tmp_path):
    done = _run(tmp_path, fail_rank=-1)
    assert done.returncode == 0, done.stderr
    assert re.findall(r"SAVED RANK (\d+)", done.stdout) == ["0"], done.stdout  # rank 0 only
    assert "worker rank 1 done" in done.stdout  # rank 1 ran the script too
    assert len(list((tmp_path / "pids").glob("*.pid"))) == 2  # two processes
    ranks = [torch.load(tmp_path / "pids" / f"state_rank{r}.pt") for r in (0, 1)]

    settings = dict(global_batch_size=16, seed=0, accelerator="cpu")
    reference = params_of(run_layout(dict(settings, max_steps=5), 1))
    one_step = params_of(run_layout(dict(settings, max_steps=1), 1))
    assert len(reference) == 6  # 3 Linear layers: weight and bias each
    for rank, state in enumerate(ranks):
        assert state.keys() == reference.keys(), (rank, sorted(state), sorted(reference))
        for name, want in reference.items():
            got = state[name]
            assert got.shape == want.shape and got.dtype == want.dtype, (rank, name)
            # the same 5 steps as one process, up to the order of the gradient all-reduce's sums
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6,
                                       msg=lambda m, r=rank, n=name: f"rank {r} {n}: {m}")
            # ... and not within reach of a run that stopped after 1 step: every tensor trained
            assert (got - one_step[name]).abs().max() > 1e-3, (rank, name)
    for name in reference:  # the ranks agree with each other exactly (DDP keeps replicas equal)
        assert torch.equal(ranks[0][name], ranks[1][name]), name


@pytest.mark.timeout(TIMEOUT + 30)
def test_failure_on_rank_1_ends_the_job(tmp_path):
    done = _run(tmp_path, fail_rank=1)
    assert done.returncode != 0
    assert "boom on rank 1" in done.stderr  # rank 1's traceback reaches the user
    # and rank 0 names the culprit with its own exit code (not the SIGTERM that stopped it)
    blame = ("worker rank 1 exited with code 1 first: RuntimeError: boom on rank 1 (its "
             "traceback is above)")
    assert done.stderr.index("boom on rank 1") < done.stderr.index(blame), done.stderr
    assert "SAVED" not in done.stdout and not list((tmp_path / "pids").glob("state_rank*.pt"))
    _assert_recorded(tmp_path, rank=1)  # rank 1's error, not rank 0's broken connection


def _assert_recorded(tmp_path, rank: int) -> None:
    """The run folder records the failing rank's own error as the run's ending."""
    environment = json.loads((tmp_path / "pids" / "run" / "environment.json").read_text())
    ending = environment["ending"]
    assert environment["status"] == "failed" and ending["rank"] == rank, environment
    assert environment["error"] == f"RuntimeError: boom on rank {rank}", environment
    assert "in loss_fn" in ending["traceback"] and not ending["lost_peer"], ending


@pytest.mark.timeout(TIMEOUT + 30)
def test_failure_on_rank_0_ends_the_job(tmp_path):
    done = _run(tmp_path, fail_rank=0)
    assert done.returncode != 0
    assert "boom on rank 0" in done.stderr
    # rank 1, stopped because rank 0 failed, is not blamed for it
    assert "WorkerFailed" not in done.stderr and "worker rank 1 exited" not in done.stderr
    assert "SAVED" not in done.stdout and not list((tmp_path / "pids").glob("state_rank*.pt"))
    _assert_recorded(tmp_path, rank=0)


TWO_FITS = """
import os, sys
from pathlib import Path

import torch.nn.functional as F
from parity import adamw, mlp, regression_data

from meshtrain import Trainer

pid_dir = Path(sys.argv[1])
(pid_dir / f"{os.getpid()}.pid").write_text(str(os.getpid()))
for devices in (1, 2):  # first try it in one process, then on two
    trainer = Trainer(devices=devices, accelerator="cpu", max_steps=2, global_batch_size=16,
                      loggers=(), progress_bar=False, save_final_checkpoint=False,
                      run_dir=pid_dir / f"run{devices}")
    trainer.fit(mlp, regression_data(), optimizer=adamw, loss_fn=F.mse_loss)
    sys.stdout.write(f"FIT devices={devices} rank {trainer.rank}\\n")
"""


@pytest.mark.timeout(TIMEOUT + 30)
def test_a_one_process_fit_before_devices_2_is_refused_before_rank_1_starts(tmp_path):
    """Rank 1 runs the script from the top: it would meet the one-process fit first and join
    rank 0's two-process job there (a gloo "Connection closed by peer" until this was refused)."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(TWO_FITS))
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    done = run_script(script, pid_dir, cwd=tmp_path, pid_dir=pid_dir, timeout=TIMEOUT)
    assert done.returncode != 0
    assert re.findall(r"FIT .*", done.stdout) == ["FIT devices=1 rank 0"], done.stdout
    assert "ConfigError: this script already trained in one process" in done.stderr, done.stderr
    assert "separate runs of the script" in done.stderr
    assert "Connection closed" not in done.stderr
    assert len(list(pid_dir.glob("*.pid"))) == 1  # no second process was started
