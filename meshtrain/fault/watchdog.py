"""Stall watchdog: when a training step runs past a time limit, the job stops with exit code
:data:`STALL_EXIT_CODE`, naming the rank that stopped advancing, with every rank's stacks in
``stacks_dir/rank{r}.txt``.

A daemon thread per rank watches the step that :meth:`StallWatchdog.arm` started and keeps this
rank's progress in the job's c10d store (``stall_blame.PROGRESS_KEY``). When a step has run
longer than ``limit_s``, the thread dumps this rank's stacks (``faulthandler.dump_traceback``,
all threads) and claims the stall (``compare_set`` of the store key ``meshtrain/stall``: one
rank finds it, any other that fired at the same moment answers instead). Every other rank's
watchdog polls that key about once a second, dumps its own stacks and answers with its progress
(step, place, collective sequence numbers). The finder waits for the answers (at most
:data:`WAIT_FOR_ANSWERS_S`), names the rank(s) that stopped advancing
(:func:`~meshtrain.fault.stall_blame.judge`: a rank that did not answer, e.g. a SIGSTOPped one,
read from outside; else one behind in steps or collectives), writes what it could read of a
silent rank into that rank's stacks file, and publishes the finding (``meshtrain/stall_verdict``).
Then every rank records it in its launcher's error file (``launch/endings.py``: the launcher
names the stalled rank, not the one that noticed), the finder records the run's ending
(``stopped_by_watchdog``, ``environment.json``, ``events.jsonl``, ``report.html``: see
``observe/ending.py``), and each rank prints one line to stderr and leaves with
``os._exit(STALL_EXIT_CODE)``. Detection takes the limit, up to a second of polling, and up to
:data:`WAIT_FOR_ANSWERS_S` more when a rank does not answer. The c10d ``TCPStore`` client is
safe to use from this thread while the main thread runs collectives and store calls (checked
on torch 2.13 with gloo).

Backstop, for a thread that never gets the GIL back (C code holding it): the watchdog thread, not
``arm()``, arms ``faulthandler.dump_traceback_later(limit_s + 30, exit=True)`` for the step it saw
start; it writes the stacks from C and exits with code 1. Re-arming faulthandler costs 60-100 µs,
too much for every step; ``arm()``/``disarm()`` only store a tuple (~0.1 µs). faulthandler holds
one such timer per process: do not use ``dump_traceback_later`` elsewhere while a watchdog runs,
and call :meth:`StallWatchdog.stop` in a ``finally`` (a step left armed keeps its timer running).
faulthandler also writes this rank's stacks on ``stall_blame.STACK_SIGNAL``, which the finder
sends to a rank on its host that is alive but did not answer.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from meshtrain.fault import stall_blame

STALL_EXIT_CODE = 3  # the exit code of every rank of a job stopped by the stall watchdog
STALL_KEY = "meshtrain/stall"  # "rank:step" of the rank that found the stall
DUMPS_KEY = "meshtrain/stall_dumps"  # ranks that dumped their stacks and answered
VERDICT_KEY = "meshtrain/stall_verdict"  # the finding: {"ranks", "cause"}
DONE_KEY = "meshtrain/stall_done"  # the finder has recorded the ending: the ranks that answered
LEAVING_KEY = "meshtrain/stall_leaving"  # ranks ready to exit: they leave together
BACKSTOP_MARGIN_S = 30.0
STORE_POLL_S = 1.0
WAIT_FOR_ANSWERS_S = 5.0  # the finder waits this long for the others' answers
WAIT_FOR_VERDICT_S = 30.0  # the others wait this long for the finding, then for the ending
EXIT_DEADLINE_S = 120.0  # once a stall is found, the process ends by then whatever hangs


def _stop_process(code: int) -> None:
    """End the process now (tests replace this to keep their own process alive)."""
    from meshtrain.launch import endings

    endings.force_exit_code(code)  # (should another thread reach the process's exit first)
    os._exit(code)


def _default_store():
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.distributed_c10d._get_default_store()
    return None


class StallWatchdog:
    """Stop the job when a step runs past ``limit_s``, naming the rank that stopped advancing.

    ``clock`` (seconds, default :func:`time.monotonic`) times the steps: :meth:`arm` and the
    thread's check against ``limit_s`` read it. Tests pass a fake one to set a step's age; how
    often the thread checks (the step and the store), and the faulthandler backstop's delay once
    armed, stay in real time.
    """

    def __init__(self, limit_s: float, stacks_dir: Path, rank: int, world_size: int, store=None,
                 *, clock: Callable[[], float] = time.monotonic):
        if limit_s <= 0:
            raise ValueError(f"limit_s must be positive, got {limit_s}")
        self.limit_s = float(limit_s)
        self.stacks_dir = Path(stacks_dir)
        self.rank, self.world_size = rank, world_size
        self.store = store
        self._clock = clock
        self.path = self.stacks_dir / f"rank{rank}.txt"
        self._current: tuple[int, float] | None = None  # (step, armed at), one atomic assignment
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._file = None
        self._backstop_for: tuple[int, float] | None = None
        self._dumped = self._existed = False
        self._last_step: int | None = None  # the last step the thread saw under way
        self._published = None  # the progress last put in the store

    # -- the training loop's side: cheap -------------------------------------------------------
    def arm(self, step: int) -> None:
        """A step begins."""
        self._current = (step, self._clock())

    def disarm(self) -> None:
        """The step ended."""
        self._current = None

    # -- lifecycle -------------------------------------------------------------------------------
    def detection_note(self) -> str:
        """What the watchdog does, said at start."""
        return (f"stall watchdog: a step (after the first) running over {self.limit_s:g} s "
                "(stall_timeout_s) stops the job, naming the rank that stopped advancing, with "
                f"every rank's stacks in {self.stacks_dir}/ (up to "
                f"{STORE_POLL_S + WAIT_FOR_ANSWERS_S:g} s more when a rank cannot answer)")

    def start(self) -> None:
        """Start the daemon thread (and open the stacks file the backstop needs)."""
        if self._thread is not None:
            return
        if self.store is None:
            self.store = _default_store()
        self.stacks_dir.mkdir(parents=True, exist_ok=True)
        self._existed = self.path.exists()  # appended to: an earlier attempt's stacks are kept
        self._file = open(self.path, "a")
        try:  # another rank's watchdog may ask for this rank's stacks from outside
            faulthandler.register(stall_blame.STACK_SIGNAL, file=self._file, all_threads=True)
        except (ValueError, RuntimeError, OSError):
            pass
        if self.rank == 0:
            logging.getLogger("meshtrain").info(self.detection_note())
        if self.store is not None:  # pid and host, for a rank that never gets to say more
            self._publish_progress(False)
        self._thread = threading.Thread(target=self._run, daemon=True, name="meshtrain-watchdog")
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread; remove the stacks file if this watchdog created it and wrote nothing."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        faulthandler.cancel_dump_traceback_later()
        try:
            faulthandler.unregister(stall_blame.STACK_SIGNAL)
        except (ValueError, RuntimeError, OSError):
            pass
        if self._file is not None:
            self._file.close()
            self._file = None
            try:  # (gone already when rank 0's run folder was removed under an error)
                empty = self.path.stat().st_size == 0
            except FileNotFoundError:
                empty = False
            if not (self._dumped or self._existed) and empty:
                self.path.unlink(missing_ok=True)
                try:
                    self.stacks_dir.rmdir()  # no empty folder left in every run folder
                except OSError:
                    pass  # not empty: another rank's file is there

    # -- the watchdog thread ---------------------------------------------------------------------
    def _run(self) -> None:
        poll = min(STORE_POLL_S, max(0.05, self.limit_s / 4))
        next_store_check = 0.0
        while not self._stop.wait(poll):
            current = self._current
            now = self._clock()
            if current is not None:
                self._last_step = current[0]
            self._update_backstop(current, now)
            if current is not None and now - current[1] > self.limit_s:
                self._fire(step=current[0], stalled_s=now - current[1])
                return
            if self.store is not None and time.monotonic() >= next_store_check:
                next_store_check = time.monotonic() + STORE_POLL_S
                self._publish_progress(current is not None)
                if self._stall_announced():
                    self._answer_request()
                    return

    def _publish_progress(self, in_step: bool) -> None:
        if (self._last_step, in_step) == self._published:
            return
        try:
            self.store.set(stall_blame.PROGRESS_KEY.format(self.rank),
                           json.dumps(stall_blame.progress(self._last_step, in_step)))
            self._published = (self._last_step, in_step)
        except Exception:  # noqa: BLE001 - store gone (its host exited)
            pass

    def _update_backstop(self, current, now: float) -> None:
        if current == self._backstop_for:
            return
        if current is None:
            faulthandler.cancel_dump_traceback_later()
        else:
            remaining = max(0.0, self.limit_s - (now - current[1]))
            faulthandler.dump_traceback_later(
                remaining + BACKSTOP_MARGIN_S, exit=True, file=self._file
            )
        self._backstop_for = current

    def _stall_announced(self) -> bool:
        try:
            return bool(self.store.check([STALL_KEY]))
        except Exception:  # store gone (its host exited): nothing to answer
            return False

    def _dump(self, header: str) -> None:
        faulthandler.cancel_dump_traceback_later()
        self._dumped = True
        self._file.write(header + "\n")
        self._file.flush()
        faulthandler.dump_traceback(self._file, all_threads=True)
        self._file.flush()
        # if a store call, py-spy or the report below hangs, the process still ends (code 1)
        faulthandler.dump_traceback_later(EXIT_DEADLINE_S, exit=True, file=self._file)

    def _my_answer(self) -> dict:
        current = self._current
        age = self._clock() - current[1] if current is not None else None
        return stall_blame.answer(self._last_step, current is not None, age)

    def _count_dump(self) -> None:
        if self.store is not None:
            try:
                self.store.add(DUMPS_KEY, 1)
            except Exception:  # noqa: BLE001
                pass

    def _claim(self, step: int) -> bool:
        """Is this rank the one that found the stall (the first to claim it)?"""
        if self.store is None:
            return True
        mine = f"{self.rank}:{step}"
        try:
            return self.store.compare_set(STALL_KEY, "", mine).decode() == mine
        except Exception:  # noqa: BLE001 - no store to agree through: report alone
            return True

    def _wait_for_answers(self) -> dict[int, dict]:
        answers = {self.rank: self._my_answer()}
        if self.store is None:
            return answers
        deadline = time.monotonic() + WAIT_FOR_ANSWERS_S
        while time.monotonic() < deadline:
            try:
                if self.store.add(DUMPS_KEY, 0) >= self.world_size:
                    break
            except Exception:  # noqa: BLE001
                break
            time.sleep(0.1)
        for rank in range(self.world_size):
            if rank != self.rank and (found := stall_blame.read_json_key(
                    self.store, stall_blame.ANSWER_KEY.format(rank))) is not None:
                answers[rank] = found
        return answers

    def _judge(self, answers: dict[int, dict]) -> stall_blame.Verdict:
        if self.world_size == 1:
            mine = answers[self.rank]
            return stall_blame.Verdict([self.rank], f"rank {self.rank} (one process) is "
                                       f"{stall_blame.where(mine)}{stall_blame._place(mine)}")
        progress_of = {r: stall_blame.read_json_key(self.store, stall_blame.PROGRESS_KEY.format(r))
                       for r in range(self.world_size) if r not in answers}
        return stall_blame.judge(answers, progress_of, self.world_size)

    def _fire(self, step: int, stalled_s: float) -> None:
        self._dump(
            f"meshtrain stall watchdog: rank {self.rank}, step {step} stalled for "
            f"{stalled_s:.1f} s (limit {self.limit_s:g} s). Python stacks of all threads "
            "(most recent call first):"
        )
        if not self._claim(step):  # another rank found it at the same moment
            self._answer_request(dumped=True)
            return
        self._count_dump()
        answers = self._wait_for_answers()
        verdict = self._judge(answers)
        for rank, text in verdict.outside.items():  # what was read of the silent ranks
            try:
                with open(self.stacks_dir / f"rank{rank}.txt", "a") as f:
                    f.write(f"meshtrain stall watchdog: rank {rank} did not answer the "
                            f"request for its stacks (step {step} stalled).\n{text}\n")
            except OSError:
                pass
        cause = (f"step {step} stalled for {stalled_s:.1f} s (limit {self.limit_s:g} s, "
                 f"found by rank {self.rank}): {verdict.cause}")
        self._publish_verdict(verdict.ranks, cause)
        try:
            from meshtrain.observe.ending import record_ending

            record_ending(self.stacks_dir.parent, "stopped_by_watchdog",
                          rank=verdict.ranks[0] if verdict.ranks else None, ranks=verdict.ranks,
                          cause=cause, step=step, path=self.stacks_dir,
                          recorded_by=f"the stall watchdog on rank {self.rank}")
        except Exception:  # noqa: BLE001 - the job stops all the same
            pass
        if self.store is not None:
            try:
                self.store.set(DONE_KEY, str(len(answers)))
            except Exception:  # noqa: BLE001
                pass
        self._say(f"meshtrain: {cause}. Every rank's stack is in {self.stacks_dir}; stopping "
                  "the job")
        self._leave(len(answers))
        stall_blame.end_stopped(verdict.stopped)  # (a launcher would wait for them)
        self._exit()

    def _publish_verdict(self, ranks: list[int], cause: str) -> None:
        from meshtrain.launch.endings import record_stall

        record_stall(cause, ranks)  # this rank's error file: its launcher names the rank
        if self.store is not None:
            try:
                self.store.set(VERDICT_KEY, json.dumps({"ranks": ranks, "cause": cause}))
            except Exception:  # noqa: BLE001
                pass

    def _answer_request(self, dumped: bool = False) -> None:
        try:
            who, step = self.store.get(STALL_KEY).decode().split(":")
        except Exception:
            who, step = "?", "?"
        if not dumped:
            self._dump(
                f"meshtrain stall watchdog: rank {self.rank}: dump requested because step "
                f"{step} stalled on rank {who}; this rank is "
                f"{stall_blame.where(self._my_answer())}. Python stacks of all threads (most "
                "recent call first):"
            )
        try:
            self.store.set(stall_blame.ANSWER_KEY.format(self.rank),
                           json.dumps(self._my_answer()))
        except Exception:  # noqa: BLE001
            pass
        self._count_dump()
        verdict = self._wait_for_key(VERDICT_KEY)
        cause = verdict["cause"] if verdict else f"step {step} stalled (found by rank {who})"
        from meshtrain.launch.endings import record_stall

        if verdict:
            record_stall(cause, verdict["ranks"])
        answered = self._wait_for_key(DONE_KEY)  # the finder records the ending (the report)
        self._say(f"meshtrain: rank {self.rank} stopping: {cause}. Every rank's stack is in "
                  f"{self.stacks_dir}")
        self._leave(int(answered) if isinstance(answered, str) and answered.isdigit() else 0)
        self._exit()

    def _wait_for_key(self, key: str):
        deadline = time.monotonic() + WAIT_FOR_VERDICT_S
        while time.monotonic() < deadline:
            try:
                if self.store.check([key]):
                    value = self.store.get(key).decode()
                    return json.loads(value) if value.startswith("{") else value
            except Exception:  # noqa: BLE001 - the store's host is gone
                return None
            time.sleep(0.1)
        return None

    def _leave(self, ranks: int) -> None:
        """Wait (a few seconds at most) until the ``ranks`` that answered are all ready to exit,
        so that none sees another's end as a failure of its own first."""
        if self.store is None or ranks <= 1:
            return
        try:
            self.store.add(LEAVING_KEY, 1)
            deadline = time.monotonic() + WAIT_FOR_ANSWERS_S
            while self.store.add(LEAVING_KEY, 0) < ranks and time.monotonic() < deadline:
                time.sleep(0.05)
        except Exception:  # noqa: BLE001 - the store's host left first
            pass

    def _say(self, line: str) -> None:
        """This rank's last line, said before it joins the others in leaving (once one rank
        exits, a rank waiting in a collective dies with the connection: its line comes first)."""
        self._file.flush()
        sys.stdout.flush()
        print(line, file=sys.stderr, flush=True)

    def _exit(self) -> None:
        from meshtrain.launch.spawn import _state

        if _state.get("workers") is not None:  # (Trainer(devices=N): this process started them)
            from meshtrain.launch import endings

            endings.force_exit_code(STALL_EXIT_CODE)
            _state["workers"].abandon()  # a stopped one would be left behind
        _stop_process(STALL_EXIT_CODE)
