"""StallWatchdog: a step that runs past the limit makes every rank dump its Python stacks and the
job stop with STALL_EXIT_CODE; quick steps never fire it."""

import os
import re
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest

from meshtrain.launch.spawn import _host_store, _worker_environ
from meshtrain.observe import watchdog as watchdog_module
from meshtrain.observe.watchdog import STALL_EXIT_CODE, StallWatchdog

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("stall_worker.py")
LIMIT_S = 2.0


def _run_stalling_job(tmp_path):
    """Rank 1 sleeps 60 s inside step 3 while rank 0 waits in an all_reduce."""
    stacks_dir = tmp_path / "stacks"
    store = _host_store(2, timedelta(seconds=60))
    procs = []
    start = time.monotonic()
    try:
        for rank in range(2):
            env = _worker_environ(rank, 2, store.port)
            env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
            env["OMP_NUM_THREADS"] = "1"
            procs.append(subprocess.Popen(
                [sys.executable, str(WORKER), str(stacks_dir), str(LIMIT_S)],
                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        outputs = [proc.communicate(timeout=60) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return procs, outputs, time.monotonic() - start, stacks_dir


@pytest.mark.timeout(120)
def test_stall_dumps_every_rank_and_stops_the_job(tmp_path):
    procs, outputs, elapsed, stacks_dir = _run_stalling_job(tmp_path)
    codes = [proc.returncode for proc in procs]
    stderr = "\n".join(err for _, err in outputs)
    print(f"exit codes {codes}, {elapsed:.1f} s (with ~3-4 s of start-up)")
    assert all(code != 0 for code in codes), (codes, stderr)
    assert STALL_EXIT_CODE in codes, (codes, stderr)
    assert elapsed < 20, elapsed
    assert not any("finished without a stall" in out for out, _ in outputs)

    line = re.search(
        r"meshtrain: step 3 stalled for [\d.]+ s on rank ([01]) \(limit 2 s\); every rank's Python "
        r"stack is in (.+); stopping the job", stderr)
    assert line, stderr
    assert Path(line.group(2)) == stacks_dir

    rank0 = (stacks_dir / "rank0.txt").read_text()
    rank1 = (stacks_dir / "rank1.txt").read_text()
    assert "sleep_inside_step" in rank1 and "train_step" in rank1, rank1
    assert "all_reduce" in rank0 and "train_step" in rank0, rank0
    for text, rank in ((rank0, 0), (rank1, 1)):
        assert text.startswith(f"meshtrain stall watchdog: rank {rank}"), text


@pytest.mark.timeout(60)
def test_quick_steps_never_fire(tmp_path, monkeypatch):
    fired = []
    monkeypatch.setattr(watchdog_module, "_stop_process", fired.append)
    watchdog = StallWatchdog(0.2, tmp_path, rank=0, world_size=1, store=None)
    watchdog.start()
    n, start = 0, time.monotonic()
    while time.monotonic() - start < 1.5:  # many quick steps, spanning several polls
        for _ in range(1000):
            watchdog.arm(n)
            watchdog.disarm()
            n += 1
    watchdog.stop()
    assert fired == []
    assert not (tmp_path / "rank0.txt").exists()  # nothing written: the empty file is removed

    cost = time.perf_counter()
    for step in range(100_000):
        watchdog.arm(step)
        watchdog.disarm()
    per_call = (time.perf_counter() - cost) / 100_000 / 2
    print(f"arm()/disarm(): {per_call * 1e6:.2f} us per call ({n} quick steps did not fire)")


def _stalled_step(watchdog):
    watchdog.arm(7)
    time.sleep(1.5)


@pytest.mark.timeout(60)
def test_one_process_stall_writes_stacks(tmp_path, monkeypatch, capsys):
    fired = []
    monkeypatch.setattr(watchdog_module, "_stop_process", fired.append)
    watchdog = StallWatchdog(0.3, tmp_path, rank=0, world_size=1, store=None)
    watchdog.start()
    _stalled_step(watchdog)
    watchdog.stop()
    assert fired == [STALL_EXIT_CODE]
    text = (tmp_path / "rank0.txt").read_text()
    assert text.startswith("meshtrain stall watchdog: rank 0, step 7 stalled for"), text
    assert "_stalled_step" in text
    assert "meshtrain: step 7 stalled for" in capsys.readouterr().err


BACKSTOP_SCRIPT = """
import ctypes, sys, time
from pathlib import Path
from meshtrain.observe import watchdog

watchdog.BACKSTOP_MARGIN_S = 1.0
dog = watchdog.StallWatchdog(0.5, Path(sys.argv[1]), rank=0, world_size=1, store=None)
dog.start()
dog.arm(1)
time.sleep(0.3)  # the watchdog thread sees the step and arms faulthandler's timer


def hold_the_gil():
    ctypes.PyDLL(None).sleep(20)  # C code that keeps the GIL: no Python thread runs


hold_the_gil()
"""


@pytest.mark.timeout(60)
def test_backstop_fires_when_the_gil_is_held(tmp_path):
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", BACKSTOP_SCRIPT, str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=50)
    elapsed = time.monotonic() - start
    text = (tmp_path / "rank0.txt").read_text()
    print(f"exit code {done.returncode} after {elapsed:.1f} s\n{text}")
    assert done.returncode == 1  # faulthandler's exit, not STALL_EXIT_CODE
    assert "Timeout (0:00:01" in text and "hold_the_gil" in text
    assert elapsed < 15
