"""Hangs and desyncs in a real Trainer run on 2 ranks: a clear error or every rank's stacks, and
a non-zero exit by the job itself, never a hang. No test here measures time: each checks which
mechanism ended the job (the watchdog's exit code, the timeout value in gloo's error, the
collective checker's report) and that the job ended by itself (``run_workers`` did not have to
kill a hung job)."""

import pytest
from fault_job import train

from meshtrain.errors import WorkerFailed
from meshtrain.launch.spawn import run_workers

HUNG = "did not finish within"  # run_workers' words when it had to kill a hung job


def _fails(argv, budget=120):
    with pytest.raises(WorkerFailed) as failure:
        run_workers(train, 2, (argv,), timeout=budget)
    text = str(failure.value)
    assert HUNG not in text, f"the job hung and was killed:\n{text[-2000:]}"
    return text


@pytest.mark.timeout(150)
def test_a_stalled_rank_gets_every_rank_stack_written_and_a_non_zero_exit(tmp_path):
    text = _fails(["--run-dir", str(tmp_path), "--layout", "dp=2", "--max-steps", "8",
                   "--fault", "stall", "--fault-step", "4", "--stall-timeout", "3",
                   "--collective-timeout", "60"])
    assert "exited with code 3" in text  # the watchdog's code, on both ranks
    stalled = (tmp_path / "stacks" / "rank1.txt").read_text()
    waiting = (tmp_path / "stacks" / "rank0.txt").read_text()
    assert "step 4" in stalled and "on_train_step_start" in stalled  # where it sleeps
    assert "_fit_loop" in waiting  # the other rank: inside the step, waiting for rank 1


@pytest.mark.timeout(150)
def test_a_skipped_collective_is_named_under_debug_collectives(tmp_path):
    # rank 1 runs an all_reduce that rank 0 does not (the mirror image of skipping one)
    text = _fails(["--run-dir", str(tmp_path), "--layout", "dp=2", "--max-steps", "8",
                   "--fault", "desync", "--fault-step", "3", "--debug-collectives"])
    assert "CollectiveMismatch" in text
    assert "rank 1" in text and "fault_job.py" in text  # the rank and its call site


@pytest.mark.timeout(150)
def test_without_debug_mode_gloo_refuses_a_mismatched_collective(tmp_path, capfd):
    # the extra all_reduce of 3 floats meets DDP's gradient all-reduce: gloo sees the sizes
    # differ and aborts rank 1 at once (SIGABRT), rank 0 loses its peer; no timeout is involved
    text = _fails(["--run-dir", str(tmp_path), "--layout", "dp=2", "--max-steps", "8",
                   "--fault", "desync", "--fault-step", "3"])
    stderr = capfd.readouterr().err  # the workers' own stderr: gloo's abort message
    assert "doesn't match expected size" in stderr, stderr[-1500:]
    assert "rank 1: exited with code -6" in text and "Connection reset by peer" in text
    assert "Timed out" not in text


@pytest.mark.timeout(150)
def test_a_rank_that_stops_calling_collectives_times_out_after_collective_timeout_s(tmp_path):
    # rank 1 sleeps inside step 3 (no watchdog); rank 0 waits in the gradient all-reduce until
    # the collective timeout, which replaced init_timeout_s after step 1, ends it
    text = _fails(["--run-dir", str(tmp_path), "--layout", "dp=2", "--max-steps", "8",
                   "--fault", "stall", "--fault-step", "3", "--collective-timeout", "4",
                   "--init-timeout", "300"])
    assert "rank 0 raised" in text
    assert "Timed out waiting 4000ms" in text, text[-1500:]


@pytest.mark.timeout(150)
def test_during_the_first_step_collectives_wait_init_timeout_s(tmp_path):
    # the first step may include slow start-up work, so it runs under init_timeout_s
    text = _fails(["--run-dir", str(tmp_path), "--layout", "dp=2", "--max-steps", "8",
                   "--fault", "stall", "--fault-step", "1", "--collective-timeout", "300",
                   "--init-timeout", "5"])
    assert "rank 0 raised" in text
    assert "Timed out waiting 5000ms" in text, text[-1500:]
