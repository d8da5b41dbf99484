"""Stall watchdog: when a training step runs past a time limit, every rank writes its Python stacks
to ``stacks_dir/rank{r}.txt`` and the job stops with exit code :data:`STALL_EXIT_CODE`.

A daemon thread per rank watches the step that :meth:`StallWatchdog.arm` started. When it has run
longer than ``limit_s``, the thread dumps this rank's stacks (``faulthandler.dump_traceback``, all
threads), sets the c10d store key ``meshtrain/stall`` to ``"rank:step"`` and counts its dump in
``meshtrain/stall_dumps``. Every other rank's watchdog polls that key about once a second, dumps its
own stacks too (stalled or not) and counts them. Each rank then waits until all ranks' dumps are
counted (at most ~5 s), prints one line to stderr and leaves with ``os._exit(STALL_EXIT_CODE)``.
The c10d ``TCPStore`` client is safe to use from this thread while the main thread runs
collectives and store calls (checked on torch 2.13 with gloo).

Backstop, for a thread that never gets the GIL back (C code holding it): the watchdog thread, not
``arm()``, arms ``faulthandler.dump_traceback_later(limit_s + 30, exit=True)`` for the step it saw
start; it writes the stacks from C and exits with code 1. Re-arming faulthandler costs 60-100 µs,
too much for every step; ``arm()``/``disarm()`` only store a tuple (~0.1 µs). faulthandler holds
one such timer per process: do not use ``dump_traceback_later`` elsewhere while a watchdog runs,
and call :meth:`StallWatchdog.stop` in a ``finally`` (a step left armed keeps its timer running).
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

STALL_EXIT_CODE = 3  # the exit code of every rank of a job stopped by the stall watchdog
STALL_KEY = "meshtrain/stall"
DUMPS_KEY = "meshtrain/stall_dumps"
BACKSTOP_MARGIN_S = 30.0
STORE_POLL_S = 1.0
WAIT_FOR_DUMPS_S = 5.0


def _stop_process(code: int) -> None:
    """End the process now (tests replace this to keep their own process alive)."""
    os._exit(code)


def _default_store():
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.distributed_c10d._get_default_store()
    return None


class StallWatchdog:
    """Dump every rank's Python stacks and stop the job when a step runs past ``limit_s``.

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

    # -- the training loop's side: cheap -------------------------------------------------------
    def arm(self, step: int) -> None:
        """A step begins."""
        self._current = (step, self._clock())

    def disarm(self) -> None:
        """The step ended."""
        self._current = None

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the daemon thread (and open the stacks file the backstop needs)."""
        if self._thread is not None:
            return
        if self.store is None:
            self.store = _default_store()
        self.stacks_dir.mkdir(parents=True, exist_ok=True)
        self._existed = self.path.exists()  # appended to: an earlier attempt's stacks are kept
        self._file = open(self.path, "a")
        self._thread = threading.Thread(target=self._run, daemon=True, name="meshtrain-watchdog")
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread; remove the stacks file if this watchdog created it and wrote nothing."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        faulthandler.cancel_dump_traceback_later()
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
            self._update_backstop(current, now)
            if current is not None and now - current[1] > self.limit_s:
                self._fire(step=current[0], stalled_s=now - current[1])
                return
            if self.store is not None and time.monotonic() >= next_store_check:
                next_store_check = time.monotonic() + STORE_POLL_S
                if self._stall_announced():
                    self._answer_request()
                    return

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
        # if a store call below hangs, the process still ends (code 1, stacks written again)
        faulthandler.dump_traceback_later(WAIT_FOR_DUMPS_S + 10, exit=True, file=self._file)
        if self.store is not None:
            try:
                self.store.add(DUMPS_KEY, 1)
            except Exception:
                pass

    def _wait_for_all_dumps(self) -> None:
        if self.store is None:
            return
        deadline = time.monotonic() + WAIT_FOR_DUMPS_S
        while time.monotonic() < deadline:
            try:
                if self.store.add(DUMPS_KEY, 0) >= self.world_size:
                    return
            except Exception:
                return
            time.sleep(0.1)

    def _fire(self, step: int, stalled_s: float) -> None:
        self._dump(
            f"meshtrain stall watchdog: rank {self.rank}, step {step} stalled for "
            f"{stalled_s:.1f} s (limit {self.limit_s:g} s). Python stacks of all threads "
            "(most recent call first):"
        )
        if self.store is not None:
            try:
                self.store.set(STALL_KEY, f"{self.rank}:{step}")
            except Exception:
                pass
        self._wait_for_all_dumps()
        message = (f"step {step} stalled for {stalled_s:.1f} s on rank {self.rank} (limit "
                   f"{self.limit_s:g} s); every rank's Python stack is in {self.stacks_dir}")
        try:  # for the report (meshtrain report): the process ends without a fit's cleanup
            from meshtrain.observe.run_files import append_event

            append_event(self.stacks_dir.parent, "watchdog", message, step, self.stacks_dir)
        except Exception:
            pass
        self._exit(f"meshtrain: {message}; stopping the job")

    def _answer_request(self) -> None:
        try:
            who, step = self.store.get(STALL_KEY).decode().split(":")
        except Exception:
            who, step = "?", "?"
        current = self._current
        where = (
            f"in step {current[0]} for {self._clock() - current[1]:.1f} s"
            if current
            else "between steps"
        )
        self._dump(
            f"meshtrain stall watchdog: rank {self.rank}: dump requested because step {step} "
            f"stalled on rank {who}; this rank is {where}. Python stacks of all threads (most "
            "recent call first):"
        )
        self._wait_for_all_dumps()
        self._exit(
            f"meshtrain: rank {self.rank} stopping: step {step} stalled on rank {who}; every "
            f"rank's Python stack is in {self.stacks_dir}"
        )

    def _exit(self, line: str) -> None:
        self._file.flush()
        sys.stdout.flush()
        print(line, file=sys.stderr, flush=True)
        _stop_process(STALL_EXIT_CODE)
