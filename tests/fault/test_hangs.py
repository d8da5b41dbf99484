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
    assert "rank 1: exited with code -6" in text
    # rank 0 then fails on its lost peer, or is stopped first by the launcher (a busy machine)
    assert "Connection reset by peer" in text or "rank 0: exited with code -9" in text, text
    assert "Timed out" not in text


@pytest.mark.timeout(150)
@pytest.mark.parametrize("hang_step, collective_s, init_s, waited_ms", [
    # after step 1 the collective timeout replaces init_timeout_s on every group
    (3, 4, 300, 4000),
    # the first step may include slow start-up work, so it runs under init_timeout_s
    (1, 300, 5, 5000),
], ids=["after-step-1", "first-step"])
def test_a_rank_that_stops_calling_collectives_ends_the_job_by_the_timeout_in_force(
        tmp_path, hang_step, collective_s, init_s, waited_ms):
    # rank 1 sleeps inside the step (no watchdog); rank 0 waits in the gradient all-reduce
    # until gloo's timeout ends it
    text = _fails(["--run-dir", str(tmp_path), "--layout", "dp=2", "--max-steps", "8",
                   "--fault", "stall", "--fault-step", str(hang_step),
                   "--collective-timeout", str(collective_s), "--init-timeout", str(init_s)])
    assert "rank 0 raised" in text
    assert f"Timed out waiting {waited_ms}ms" in text, text[-1500:]
