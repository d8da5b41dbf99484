"""stop_on_signal: a signal to one rank (what Slurm's `--signal=USR1@T` or `scancel --signal=USR1`
sends before a preemption or the time limit) stops every rank after the same step with a
resumable checkpoint; running again continues exactly where it stopped."""

import json

import pytest
from fault_job import mlp, train
from records import assert_equal_weights, final_weights

from meshtrain.launch.spawn import run_workers

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _job(run_dir, *extra, layout="dp=2"):
    return ["--run-dir", str(run_dir), "--layout", layout, "--max-steps", "8", *extra]


def _unfinished(run_dir) -> int:
    """The step of checkpoints/final, which must be marked to be continued."""
    summary = json.loads((run_dir / "checkpoints" / "final" / "meshtrain.json").read_text())
    return summary["step"]


def _status(run_dir) -> tuple[str, int]:
    """environment.json's status and the step its ending names."""
    environment = json.loads((run_dir / "environment.json").read_text())
    assert environment["ending"]["status"] == environment["status"], environment
    return environment["status"], environment["ending"]["step"]


@pytest.mark.timeout(150)
def test_a_signal_to_one_rank_stops_all_after_the_same_step_and_the_run_continues(tmp_path):
    stopped = run_workers(train, 2, (_job(tmp_path / "run", "--fault", "signal", "--fault-step",
                                          "3", "--stop-on-signal", "SIGUSR1"),), timeout=100)
    # rank 1 got SIGUSR1 at the start of step 3; the flag exchange started in step 3 is read
    # in step 4 by both ranks, which stop after it
    assert [(r["global_step"], r["stop_reason"]) for r in stopped] == [(4, "signal")] * 2
    assert _unfinished(tmp_path / "run") == 4
    assert _status(tmp_path / "run") == ("preempted", 4)  # what a monitor reads
    again = run_workers(train, 2, (_job(tmp_path / "run"),), timeout=100)
    assert [(r["global_step"], r["stop_reason"]) for r in again] == [(8, None)] * 2
    assert _status(tmp_path / "run") == ("finished", 8)
    straight = run_workers(train, 2, (_job(tmp_path / "straight"),), timeout=100)
    assert [r["global_step"] for r in straight] == [8, 8]
    assert_equal_weights(final_weights(tmp_path / "run", mlp),
                         final_weights(tmp_path / "straight", mlp))


@pytest.mark.timeout(100)
def test_one_process_stops_on_sigusr1_by_default(tmp_path):
    (result,) = run_workers(train, 1, (_job(tmp_path, "--fault", "signal", "--fault-step", "5",
                                            "--fault-rank", "0", layout="dp=1"),), timeout=60)
    assert (result["global_step"], result["stop_reason"]) == (5, "signal")
    assert _unfinished(tmp_path) == 5
