"""`Trainer(devices=2)` in a script started with plain `python script.py`: rank 0 starts rank 1 by
running the script again (ScriptWorkers). A success must match one process; a failure on either
rank must end the job with a non-zero exit, the traceback, and no hang."""

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from parity import LOSSES, run_layout

ROOT = Path(__file__).resolve().parents[2]
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
assert trainer.world_size == 2 and trainer.layout.dp_degree == 2
# one write per line (stdout may be unbuffered): the two ranks' lines never interleave
if trainer.is_global_zero:
    checksum = sum(p.detach().double().sum().item() for p in model.parameters())
    sys.stdout.write(f"CHECKSUM {checksum!r} RANK {trainer.rank}\\n")
else:
    sys.stdout.write(f"worker rank {trainer.rank} done\\n")
"""


def _run(tmp_path, fail_rank: int) -> tuple[subprocess.CompletedProcess, float]:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT))
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    env = dict(os.environ)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MESHTRAIN_STORE"):
        env.pop(name, None)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT), str(ROOT / "tests"), *filter(None, [env.get("PYTHONPATH")])])
    env["OMP_NUM_THREADS"] = "1"
    start = time.monotonic()
    try:
        done = subprocess.run([sys.executable, str(script), str(pid_dir), str(fail_rank)],
                              env=env, capture_output=True, text=True, timeout=TIMEOUT,
                              cwd=tmp_path)
    finally:
        # rank 1 runs in its own session: end any process of this job that is still there
        for pid_file in pid_dir.glob("*.pid"):
            try:
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
    return done, time.monotonic() - start


@pytest.mark.timeout(TIMEOUT + 30)
def test_devices_2_script_matches_one_process(tmp_path):
    done, _ = _run(tmp_path, fail_rank=-1)
    assert done.returncode == 0, done.stderr
    found = re.findall(r"CHECKSUM (\S+) RANK (\d+)", done.stdout)
    assert len(found) == 1 and found[0][1] == "0", done.stdout  # printed by rank 0 only
    assert "worker rank 1 done" in done.stdout  # rank 1 ran the script too
    assert len(list((tmp_path / "pids").glob("*.pid"))) == 2  # two processes
    checksum = float(found[0][0])

    reference = run_layout(dict(max_steps=5, global_batch_size=16, seed=0, accelerator="cpu"), 1)
    expected = sum(v.double().sum().item() for k, v in reference.items() if k != LOSSES)
    assert abs(checksum - expected) <= 1e-5, (checksum, expected)
    one_step = run_layout(dict(max_steps=1, global_batch_size=16, seed=0, accelerator="cpu"), 1)
    one_sum = sum(v.double().sum().item() for k, v in one_step.items() if k != LOSSES)
    assert abs(one_sum - expected) > 1e-3


@pytest.mark.timeout(TIMEOUT + 30)
def test_failure_on_rank_1_ends_the_job(tmp_path):
    done, elapsed = _run(tmp_path, fail_rank=1)
    assert done.returncode != 0
    assert "boom on rank 1" in done.stderr  # rank 1's traceback reaches the user
    # and rank 0 names the culprit with its own exit code (not the SIGTERM that stopped it)
    assert "worker rank 1 exited with code 1;" in done.stderr.split("boom on rank 1")[-1]
    assert "CHECKSUM" not in done.stdout
    assert elapsed < TIMEOUT


@pytest.mark.timeout(TIMEOUT + 30)
def test_failure_on_rank_0_ends_the_job(tmp_path):
    done, elapsed = _run(tmp_path, fail_rank=0)
    assert done.returncode != 0
    assert "boom on rank 0" in done.stderr
    # rank 1, stopped because rank 0 failed, is not blamed for it
    assert "WorkerFailed" not in done.stderr and "worker rank 1 exited" not in done.stderr
    assert "CHECKSUM" not in done.stdout
    assert elapsed < TIMEOUT
