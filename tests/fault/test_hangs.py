"""Hangs and desyncs in a real Trainer run on 2 ranks: a clear error or every rank's stacks, and
a non-zero exit by the job itself, never a hang. No test here measures time: each checks which
mechanism ended the job (the watchdog's exit code, the timeout value in gloo's error, the
collective checker's report) and that the job ended by itself (``run_workers`` did not have to
kill a hung job)."""

import json
import re

import pytest
from fault_job import train

from meshtrain.errors import WorkerFailed
from meshtrain.launch.spawn import run_workers
from meshtrain.observe.run_files import read_events

HUNG = "did not finish within"  # run_workers' words when it had to kill a hung job


def _fails(argv, budget=120):
    with pytest.raises(WorkerFailed) as failure:
        run_workers(train, 2, (argv,), timeout=budget)
    text = str(failure.value)
    assert HUNG not in text, f"the job hung and was killed:\n{text[-2000:]}"
    return text


@pytest.mark.timeout(150)
def test_a_stopped_rank_is_named_by_the_watchdog_and_recorded_as_the_runs_ending(
        tmp_path, capfd):
    # rank 1 SIGSTOPs itself inside step 4 (it cannot run Python, not even its watchdog);
    # rank 0 waits for it in the gradient all-reduce. (A rank asleep in Python, which answers:
    # tests/fault/test_watchdog.py.)
    text = _fails(["--run-dir", str(tmp_path), "--layout", "dp=2", "--max-steps", "8",
                   "--fault", "stop", "--fault-step", "4", "--stall-timeout", "3",
                   "--collective-timeout", "60"])
    assert "rank 0: exited with code 3" in text  # the watchdog's code; rank 1 was killed
    out, err = capfd.readouterr()
    stopped = re.compile(r"rank 1 did not answer: its process \(pid (\d+)\) is stopped \(state T "
                         r"in /proc/\d+/status: SIGSTOP or job control\), so it cannot run Python")
    line = re.search(r"meshtrain: step 4 stalled for [\d.]+ s \(limit 3 s, found by rank 0\): "
                     + stopped.pattern + r".*; the others wait: rank 0 is in step 4\. Every "
                     r"rank's stack is in ", err)
    assert line, err[-3000:]
    assert "stall watchdog: a step (after the first) running over 3 s (stall_timeout_s) stops " \
        "the job" in out  # said at start (rank 0's lines)
    # rank 1's stacks file: what could be read from outside (it cannot write its own)
    outside = (tmp_path / "stacks" / "rank1.txt").read_text()
    assert f"Rank 1, pid {line.group(1)} on " in outside and "state: T (stopped)" in outside
    assert "do_signal_stop" in outside  # its kernel wait channel
    assert "Python stack: " in outside, outside
    assert "_fit_loop" in (tmp_path / "stacks" / "rank0.txt").read_text()  # waiting for rank 1
    # the run's status, its events and its report say the same, with rank 1
    environment = json.loads((tmp_path / "environment.json").read_text())
    ending = environment["ending"]
    assert environment["status"] == ending["status"] == "stopped_by_watchdog", environment
    assert ending["rank"] == 1 and ending["ranks"] == [1] and ending["step"] == 4, ending
    assert stopped.search(ending["cause"]) and environment["finished"], ending
    assert ending["recorded_by"] == "the stall watchdog on rank 0"
    events = [e for e in read_events(tmp_path) if e["kind"] == "watchdog"]
    assert len(events) == 1 and stopped.search(events[0]["message"]), events
    assert events[0]["path"] == "stacks" and events[0]["step"] == 4
    report = (tmp_path / "report.html").read_text()
    assert "stopped_by_watchdog</span>" in report and stopped.search(report), report[:2000]


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
