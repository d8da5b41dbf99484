"""StallWatchdog: a step that runs past the limit makes every rank dump its Python stacks and the
job stop with STALL_EXIT_CODE; quick steps never fire it. In-process tests set the steps' ages
with a fake clock and wait on events, not on real time."""

import re
import subprocess
import sys
import threading
from datetime import timedelta
from pathlib import Path

import pytest
from conftest import ROOT, script_env

from meshtrain.launch.spawn import _host_store, _worker_environ
from meshtrain.fault import watchdog as watchdog_module
from meshtrain.fault.watchdog import STALL_EXIT_CODE, StallWatchdog

WORKER = Path(__file__).with_name("stall_worker.py")
LIMIT_S = 2.0


def _run_stalling_job(tmp_path):
    """Rank 1 sleeps 60 s inside step 3 while rank 0 waits in an all_reduce."""
    stacks_dir = tmp_path / "stacks"
    store = _host_store(2, timedelta(seconds=60))
    procs = []
    try:
        for rank in range(2):
            procs.append(subprocess.Popen(
                [sys.executable, str(WORKER), str(stacks_dir), str(LIMIT_S)],
                env=script_env(_worker_environ(rank, 2, store.port)), stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, text=True))
        outputs = [proc.communicate(timeout=60) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return procs, outputs, stacks_dir


@pytest.mark.timeout(120)
def test_stall_dumps_every_rank_and_stops_the_job(tmp_path):
    procs, outputs, stacks_dir = _run_stalling_job(tmp_path)  # raises if it runs 60 s: no stop
    codes = [proc.returncode for proc in procs]
    stderr = "\n".join(err for _, err in outputs)
    print(f"exit codes {codes}")
    assert all(code != 0 for code in codes), (codes, stderr)
    assert STALL_EXIT_CODE in codes, (codes, stderr)
    assert not any("finished without a stall" in out for out, _ in outputs)

    # whichever rank noticed first, the line names rank 1, which stopped calling collectives,
    # and where it is; the waiting rank 0 is not blamed
    line = re.search(
        r"meshtrain: step 3 stalled for ([\d.]+) s \(limit 2 s, found by rank ([01])\): rank 1 "
        r"stopped before a collective the others wait in: it is in step 3 \(for [\d.]+ s\) in "
        r"sleep_inside_step \(stall_worker.py:\d+\) and has started (\d+) collectives on group "
        r"\S+, the others (\d+)\. Every rank's stack is in (.+); stopping the job", stderr)
    assert line, stderr
    assert float(line.group(1)) >= LIMIT_S  # it fired past the limit, not before
    assert int(line.group(3)) + 1 == int(line.group(4))  # rank 0 waits in the next all_reduce
    assert Path(line.group(5)) == stacks_dir
    other = 1 - int(line.group(2))  # the rank that answered says the same before it stops
    assert f"meshtrain: rank {other} stopping: step 3 stalled" in stderr and stderr.count(
        "rank 1 stopped before a collective") == 2, stderr

    rank0 = (stacks_dir / "rank0.txt").read_text()
    rank1 = (stacks_dir / "rank1.txt").read_text()
    assert "sleep_inside_step" in rank1 and "train_step" in rank1, rank1
    assert "all_reduce" in rank0 and "train_step" in rank0, rank0
    for text, rank in ((rank0, 0), (rank1, 1)):
        assert text.startswith(f"meshtrain stall watchdog: rank {rank}"), text


# Waits in this process stay under the 15 s after which a fired watchdog's faulthandler timer
# ends the process (the test's finally: stop() cancels it), so a failure is reported, not lost.
WAIT_S = 10.0


class Stops:
    """Stands in for ending the process: records the exit codes, and wakes whoever waits."""

    def __init__(self) -> None:
        self.codes: list[int] = []
        self.changed = threading.Condition()

    def __call__(self, code: int) -> None:
        with self.changed:
            self.codes.append(code)
            self.changed.notify_all()

    def wait(self, timeout: float = WAIT_S) -> bool:
        with self.changed:
            return self.changed.wait_for(lambda: bool(self.codes), timeout)


@pytest.fixture
def stops(monkeypatch):
    stops = Stops()
    monkeypatch.setattr(watchdog_module, "_stop_process", stops)
    return stops


class WatchdogClock:
    """A fake clock for StallWatchdog: the test sets the time; the reads from other threads (the
    watchdog's) are counted, so that the test can wait until the watchdog has checked the step
    as it is now."""

    def __init__(self, stops: Stops) -> None:
        self.now = 0.0
        self._owner = threading.get_ident()
        self._reads = 0
        self._stops = stops
        self._changed = stops.changed

    def __call__(self) -> float:
        with self._changed:
            if threading.get_ident() != self._owner:
                self._reads += 1
                self._changed.notify_all()
            return self.now

    def advance(self, seconds: float) -> None:
        with self._changed:
            self.now += seconds

    def wait_for_check(self, timeout: float = WAIT_S) -> bool:
        """Wait until the watchdog has read the step and then the clock after this call (each
        check reads the step first, so that takes two reads of the clock); False if it fired
        instead, or never checked."""
        with self._changed:
            target = self._reads + 2
            self._changed.wait_for(lambda: self._reads >= target or self._stops.codes, timeout)
            return self._reads >= target and not self._stops.codes


@pytest.mark.timeout(60)
def test_quick_steps_never_fire(tmp_path, stops):
    clock = WatchdogClock(stops)
    watchdog = StallWatchdog(0.2, tmp_path, rank=0, world_size=1, store=None, clock=clock)
    watchdog.start()
    try:
        # 10 steps of 0.08 s, 0.02 s apart: 1 s in all, five limits. (Two steps and a gap stay
        # under the limit, since a check may read a step just before it ends and the time later.)
        for step in range(10):
            watchdog.arm(step)
            clock.advance(0.08)
            assert clock.wait_for_check(), stops.codes  # checked while the step runs
            watchdog.disarm()
            clock.advance(0.02)
        assert clock.wait_for_check(), stops.codes
        clock.advance(10.0)  # a long time between steps (evaluation, a checkpoint) is no stall
        assert clock.wait_for_check(), stops.codes
    finally:
        watchdog.stop()
    assert stops.codes == []
    assert not (tmp_path / "rank0.txt").exists()  # nothing written: the empty file is removed


@pytest.mark.timeout(60)
def test_stop_after_the_run_folder_was_removed(tmp_path, stops):
    """Under an error rank 0 may remove the shared run folder while another rank stops its
    watchdog: stopping must not raise FileNotFoundError over the real error."""
    import shutil

    watchdog = StallWatchdog(5.0, tmp_path / "stacks", rank=1, world_size=1, store=None,
                             clock=WatchdogClock(stops))
    watchdog.start()
    shutil.rmtree(tmp_path / "stacks")
    watchdog.stop()
    assert stops.codes == []


def _stalled_step(watchdog, clock, stops):
    watchdog.arm(7)
    clock.advance(1.5)  # the step has run for 1.5 s
    return stops.wait()  # in this frame while the watchdog dumps the stacks


@pytest.mark.timeout(60)
def test_one_process_stall_writes_stacks(tmp_path, stops, capsys):
    clock = WatchdogClock(stops)
    watchdog = StallWatchdog(0.3, tmp_path, rank=0, world_size=1, store=None, clock=clock)
    watchdog.start()
    try:
        assert _stalled_step(watchdog, clock, stops), "the watchdog did not fire"
    finally:
        watchdog.stop()
    assert stops.codes == [STALL_EXIT_CODE]
    text = (tmp_path / "rank0.txt").read_text()
    assert text.startswith("meshtrain stall watchdog: rank 0, step 7 stalled for 1.5 s (limit "
                           "0.3 s)"), text
    assert "_stalled_step" in text
    assert ("meshtrain: step 7 stalled for 1.5 s (limit 0.3 s, found by rank 0): rank 0 (one "
            "process) is in step 7 (for 1.5 s)") in capsys.readouterr().err


BACKSTOP_SCRIPT = """
import ctypes, faulthandler, sys, threading
from pathlib import Path
from meshtrain.fault import watchdog

backstop_armed = threading.Event()


class SignallingFaulthandler:
    def __getattr__(self, name):
        return getattr(faulthandler, name)

    def dump_traceback_later(self, *args, **kwargs):
        faulthandler.dump_traceback_later(*args, **kwargs)
        backstop_armed.set()


watchdog.faulthandler = SignallingFaulthandler()
watchdog.BACKSTOP_MARGIN_S = 1.0
# a clock that stands still: the watchdog thread itself never sees the step past its limit
dog = watchdog.StallWatchdog(0.5, Path(sys.argv[1]), rank=0, world_size=1, store=None,
                             clock=lambda: 0.0)
dog.start()
dog.arm(1)
if not backstop_armed.wait(30):  # the watchdog thread saw the step and armed faulthandler
    print("the backstop was never armed", file=sys.stderr)
    sys.exit(5)


def hold_the_gil():
    ctypes.PyDLL(None).sleep(20)  # C code that keeps the GIL: no Python thread runs


hold_the_gil()
"""


@pytest.mark.timeout(60)
def test_backstop_fires_when_the_gil_is_held(tmp_path):
    done = subprocess.run([sys.executable, "-c", BACKSTOP_SCRIPT, str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=50)
    text = (tmp_path / "rank0.txt").read_text()
    print(f"exit code {done.returncode}\n{done.stderr}\n{text}")
    assert done.returncode == 1  # faulthandler's exit, not STALL_EXIT_CODE
    # armed for the rest of the limit plus the margin: 0.5 s + 1 s
    assert "Timeout (0:00:01.500000)!" in text and "hold_the_gil" in text
