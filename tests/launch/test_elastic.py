"""`meshtrain run --max-restarts K`: a worker killed with SIGKILL on attempt 0, real gloo workers.

The job is tests/launch/elastic_worker.py (rank 1 SIGKILLs itself after 3 all_reduces on attempt
0). With a restart left, attempt 1 must re-form the group on the per-attempt store and finish
with correct sums; with none, the job fails with a summary that names the killed rank.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT

from meshtrain.launch.spawn import restart_count
from meshtrain.launch.torchrun import restart_notice, restarts_done

WORKER = Path(__file__).with_name("elastic_worker.py")
STEPS, KILL_AFTER = 5, 3


def _meshtrain_run(tmp_path: Path, max_restarts: int, *script_args: str):
    command = [
        sys.executable, "-m", "meshtrain.cli", "run", "--nproc-per-node", "2",
        "--max-restarts", str(max_restarts), "--log-dir", str(tmp_path / "logs"),
        str(WORKER), str(tmp_path), "--steps", str(STEPS), "--kill-after", str(KILL_AFTER),
        *script_args,
    ]
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=110)
    markers = {p.stem: json.loads(p.read_text()) for p in tmp_path.glob("attempt*_rank*.json")}
    return proc, markers


def _sums(attempt: int, steps: int) -> list[float]:
    """What the worker's all_reduces give on 2 ranks: (1 + 2) * (step + 1) + 2 * 100 * attempt."""
    return [float(3 * (step + 1) + 200 * attempt) for step in range(steps)]


@pytest.mark.timeout(120)
def test_killed_worker_is_restarted_and_the_new_group_works(tmp_path):
    proc, markers = _meshtrain_run(tmp_path, 1)

    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(markers) == [
        "attempt0_rank0", "attempt0_rank1", "attempt1_rank0", "attempt1_rank1"
    ]
    killed = markers["attempt0_rank1"]
    assert "killed" in killed and not killed["done"]
    assert killed["sums"] == _sums(0, KILL_AFTER)  # attempt 0 worked until the kill
    assert not markers["attempt0_rank0"]["done"]  # stopped by torchrun (or failed on its peer)
    for rank in (0, 1):
        again = markers[f"attempt1_rank{rank}"]
        assert again["env_restart_count"] == "1" and again["attempt"] == 1
        assert again["done"] and again["world_size"] == 2
        assert again["sums"] == _sums(1, STEPS)  # also checked in the worker: it raises if wrong
        assert again["pid"] != markers[f"attempt0_rank{rank}"]["pid"]

    said = [line for line in proc.stderr.splitlines() if line.startswith("meshtrain run:")]
    assert said[0] == restart_notice(1)
    assert len(said) == 2 and "restarted once after a failure" in said[1]
    assert "the last attempt succeeded" in said[1]


@pytest.mark.timeout(120)
def test_without_restarts_the_killed_worker_fails_the_job(tmp_path):
    # Rank 0 sleeps instead of failing on its lost peer, so rank 1 is surely the first failure.
    proc, markers = _meshtrain_run(tmp_path, 0, "--survivor", "sleep")

    assert proc.returncode == 1
    assert sorted(markers) == ["attempt0_rank0", "attempt0_rank1"]
    summary = [line for line in proc.stderr.splitlines() if line.startswith("meshtrain run:")]
    assert len(summary) == 1, summary  # no restart notice, no restart count
    assert "rank 1 (local rank 1" in summary[0]
    assert "was killed by signal SIGKILL" in summary[0]


def test_restart_count_reads_torchelastic(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    assert restart_count() == 0
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    assert restart_count() == 2


def test_restarts_are_counted_from_new_attempt_log_folders(tmp_path):
    (tmp_path / "old-run_x" / "attempt_3").mkdir(parents=True)
    before = {str(tmp_path / "old-run_x" / "attempt_3")}
    assert restarts_done(str(tmp_path), before) == 0
    for attempt in (0, 1, 2):
        (tmp_path / "new-run_y" / f"attempt_{attempt}").mkdir(parents=True)
    assert restarts_done(str(tmp_path), before) == 2
    assert restarts_done(None) == 0
