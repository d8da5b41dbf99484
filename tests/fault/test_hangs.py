"""Hangs and desyncs in a real Trainer run on 2 ranks: a clear error or every rank's stacks, and
a non-zero exit within the limit, never a hang."""

import time

import pytest
from fault_job import train

from meshtrain.errors import WorkerFailed
from meshtrain.launch.spawn import run_workers


def _fails_within(argv, seconds):
    start = time.monotonic()
    with pytest.raises(WorkerFailed) as failure:
        run_workers(train, 2, (argv,), timeout=seconds + 60)
    elapsed = time.monotonic() - start
    assert elapsed < seconds, f"took {elapsed:.1f} s"
    return str(failure.value)


@pytest.mark.timeout(150)
def test_a_stalled_rank_gets_every_rank_stack_written_and_a_non_zero_exit(tmp_path):
    text = _fails_within(["--run-dir", str(tmp_path), "--layout", "dp=2", "--max-steps", "8",
                          "--fault", "stall", "--fault-step", "4", "--stall-timeout", "3",
                          "--collective-timeout", "60"], seconds=45)
    assert "exited with code 3" in text  # the watchdog's code, on both ranks
    stalled = (tmp_path / "stacks" / "rank1.txt").read_text()
    waiting = (tmp_path / "stacks" / "rank0.txt").read_text()
    assert "step 4" in stalled and "on_train_step_start" in stalled  # where it sleeps
    assert "_fit_loop" in waiting  # the other rank: inside the step, waiting for rank 1


@pytest.mark.timeout(150)
def test_a_skipped_collective_is_named_under_debug_collectives(tmp_path):
    # rank 1 runs an all_reduce that rank 0 does not (the mirror image of skipping one)
    text = _fails_within(["--run-dir", str(tmp_path), "--layout", "dp=2", "--max-steps", "8",
                          "--fault", "desync", "--fault-step", "3", "--debug-collectives"],
                         seconds=60)
    assert "CollectiveMismatch" in text
    assert "rank 1" in text and "fault_job.py" in text  # the rank and its call site


@pytest.mark.timeout(150)
def test_without_debug_mode_a_desync_still_ends_within_the_timeout(tmp_path):
    text = _fails_within(["--run-dir", str(tmp_path), "--layout", "dp=2", "--max-steps", "8",
                          "--fault", "desync", "--fault-step", "3", "--collective-timeout", "8",
                          "--stall-timeout", "6"], seconds=45)
    assert "rank" in text
