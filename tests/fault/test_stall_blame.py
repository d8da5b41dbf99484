"""stall_blame.judge: the rank that stopped advancing is named, not the ranks waiting for it, from
every rank's answer (step, collectives started per group) or its silence (its process read from
/proc). Pure functions on made-up answers, and one real stopped process."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from meshtrain.fault import stall_blame
from meshtrain.fault.stall_blame import judge


def _answer(step, in_step=True, seqs=None, place=None, age_s=3.0):
    return {"step": step, "in_step": in_step, "age_s": age_s, "seqs": seqs or {},
            "place": place, "pid": 1, "host": stall_blame.HOST}


def test_a_rank_behind_in_its_collectives_is_named_not_the_ones_waiting():
    answers = {0: _answer(4, seqs={"0": 13, "1": 5}), 1: _answer(4, seqs={"0": 12, "1": 5},
                                                                place="load (data.py:9)"),
               2: _answer(4, seqs={"0": 13, "1": 5})}
    verdict = judge(answers, {}, 3)
    assert verdict.ranks == [1]
    assert verdict.cause == ("rank 1 stopped before a collective the others wait in: it is in "
                             "step 4 (for 3.0 s) in load (data.py:9) and has started 12 "
                             "collectives on group 0, the others 13")


def test_a_rank_in_an_earlier_step_is_named():
    # rank 2 hangs between steps (a checkpoint, validation) while the others started step 5
    answers = {0: _answer(5), 1: _answer(5), 2: _answer(4, in_step=False)}
    verdict = judge(answers, {}, 3)
    assert verdict.ranks == [2]
    assert verdict.cause.startswith("rank 2 is behind: it is between steps (after step 4), "
                                    "while the others are in step 5"), verdict.cause


def test_no_rank_is_named_when_none_is_behind():
    answers = {r: _answer(4, seqs={"0": 7}) for r in range(2)}
    verdict = judge(answers, {}, 2)
    assert verdict.ranks == []
    assert verdict.cause.startswith("no rank is behind: every rank is in step 4"), verdict.cause


def test_a_rank_on_another_host_that_did_not_answer_is_named_with_where_to_look():
    answers = {0: _answer(4)}
    progress = {1: {"step": 3, "in_step": False, "pid": 4242, "host": "node-b"}}
    verdict = judge(answers, progress, 2)
    assert verdict.ranks == [1]
    assert verdict.cause == ("rank 1 did not answer: pid 4242 on host node-b, which cannot be "
                             f"looked at from {stall_blame.HOST}; last heard of between steps "
                             "(after step 3); the others wait: rank 0 is in step 4")
    assert "py-spy dump --pid 4242" in verdict.outside[1]


@pytest.mark.timeout(30)
def test_a_stopped_process_is_read_from_outside():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        os.kill(proc.pid, signal.SIGSTOP)
        while "State:\tT" not in Path(f"/proc/{proc.pid}/status").read_text():
            time.sleep(0.01)
        progress = {1: {"step": 4, "in_step": True, "pid": proc.pid, "host": stall_blame.HOST}}
        verdict = judge({0: _answer(4)}, progress, 2)
        assert verdict.stopped == [proc.pid]
        stall_blame.end_stopped(verdict.stopped)  # what the finder does before it exits
        assert proc.wait(timeout=10) == -signal.SIGTERM
    finally:
        proc.kill()
        proc.wait()
    assert verdict.ranks == [1]
    assert verdict.cause.startswith(
        f"rank 1 did not answer: its process (pid {proc.pid}) is stopped (state T in "
        f"/proc/{proc.pid}/status: SIGSTOP or job control), so it cannot run Python; last "
        "heard of in step 4;"), verdict.cause
    text = verdict.outside[1]
    assert "state: T (stopped)" in text and "do_signal_stop" in text, text
    assert "Python stack: " in text  # py-spy's, or why there is none


@pytest.mark.timeout(30)
def test_a_live_silent_rank_is_asked_for_its_stacks_only_if_it_catches_the_signal(tmp_path):
    # a process whose faulthandler writes its stacks on STACK_SIGNAL (as a watchdog's does),
    # and one that does not catch it (the signal would end it: it is not sent)
    code = ("import faulthandler, sys, time; faulthandler.register({}, file=open(sys.argv[1], "
            "'w'), all_threads=True); print('ready', flush=True); time.sleep(60)")
    ready = subprocess.Popen([sys.executable, "-c", code.format(int(stall_blame.STACK_SIGNAL)),
                              str(tmp_path / "stacks.txt")], stdout=subprocess.PIPE, text=True)
    plain = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert ready.stdout.readline() == "ready\n"
        progress = {r: {"step": 4, "in_step": True, "pid": p.pid, "host": stall_blame.HOST}
                    for r, p in ((1, ready), (2, plain))}
        verdict = judge({0: _answer(4)}, progress, 3)
        deadline = time.monotonic() + 20
        while "<module>" not in (tmp_path / "stacks.txt").read_text():
            assert time.monotonic() < deadline, "no stacks written"
            time.sleep(0.05)
        assert plain.poll() is None  # not signalled: still alive
    finally:
        for proc in (ready, plain):
            proc.kill()
            proc.wait()
    assert verdict.ranks == [1, 2]
    assert "is alive but its watchdog thread did not run" in verdict.cause
    assert "asked it for its stacks" in verdict.outside[1]
    assert "asked it for its stacks" not in verdict.outside[2]
