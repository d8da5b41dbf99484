"""How a process of a meshtrain job ends: its exit code, what it records when it fails, and how
the process that started the ranks names the one that failed first.

**Exit code.** The processes a meshtrain launcher started leave through ``os._exit``
(``spawn._shutdown``), which would drop the code Python was about to exit with. :func:`install`
keeps it: 1 after an uncaught exception, else the code given to ``sys.exit`` (``meshtrain
train`` exits 2 after a refused setting, on any rank), else 0.

**Failure record.** A failing rank writes its error, the time and whether it only lost a peer
(:func:`lost_peer`: a broken connection after another rank died) to its error file:
torchrun's ``TORCHELASTIC_ERROR_FILE`` (in torchrun's own format, so its report shows the
error), or the one ``Trainer(devices=N)`` gives each rank (``MESHTRAIN_ERROR_FILE``).

**The first failure** (:func:`first_failure`): the rank the stall watchdog named, when a rank's
record says the watchdog stopped the job (:func:`record_stall`; the ranks it named stopped
advancing, the others only waited for them), else a rank killed by a signal that the launcher
did not send (SIGKILL from ``kill -9`` or the out-of-memory killer: it records nothing), else the
earliest error that is not a lost peer, else a rank that exited non-zero without a record, else
the earliest lost peer. Errors are timed when they reach the top of their process, so between two
ranks that failed by themselves within a moment of each other "first" is approximate.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass

ERROR_FILE_ENV = "MESHTRAIN_ERROR_FILE"  # Trainer(devices=N)'s ranks (launch/script_workers.py)
TORCHRUN_ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"  # torchrun's (`meshtrain run`)
_exit = {"uncaught": False, "code": None, "installed": False, "forced": None}

#: what a gloo / NCCL / store error says when the process at the other end has gone away
LOST_PEER = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
             "remote process exited", "failed to recv, got 0 bytes")


def install() -> None:
    """Keep this process's exit code and record its failure (once per process): uncaught
    exceptions through ``sys.excepthook``, the code of ``sys.exit(code)``."""
    if _exit["installed"]:
        return
    previous_hook, previous_exit = sys.excepthook, sys.exit

    def hook(kind, error, tb):
        mark_uncaught()
        if not isinstance(error, KeyboardInterrupt):
            record_failure(error, shown="traceback", tb=tb)
        previous_hook(kind, error, tb)

    def exit_with(code=None):
        if threading.current_thread() is threading.main_thread():  # (elsewhere: ends a thread)
            note_exit_code(code)
        previous_exit(code)

    sys.excepthook, sys.exit = hook, exit_with
    _exit["installed"] = True


def mark_uncaught() -> None:
    _exit["uncaught"] = True


def note_exit_code(code) -> None:
    """``sys.exit(code)``'s code as the process will report it (None 0, a message 1)."""
    _exit["code"] = 0 if code is None else code if isinstance(code, int) else 1


def ends_with(error: BaseException, code: int) -> None:
    """This process will exit with ``code`` after ``error``, which it printed as a message (the
    command line's refusals: ``sys.exit(main())`` fetched ``sys.exit`` before the wrapper)."""
    note_exit_code(code)
    record_failure(error, shown="message")


def force_exit_code(code: int) -> None:
    """This process ends with ``code`` whatever else happens (the stall watchdog's)."""
    _exit["forced"] = code


def exit_code() -> int:
    """The code this process exits with: one forced, else 1 after an uncaught exception, else
    sys.exit's, else 0."""
    if _exit["forced"] is not None:
        return _exit["forced"]
    code = 1 if _exit["uncaught"] else (_exit["code"] or 0)
    return code if 0 <= code <= 255 else 1  # (os._exit(256) would say success)


def lost_peer(error: BaseException | None) -> bool:
    """Did ``error`` only follow from another process's end (a connection it held broke)?"""
    from meshtrain.errors import WorkerFailed

    if isinstance(error, WorkerFailed):
        return True
    text = str(error)
    return any(phrase in text for phrase in LOST_PEER)


def error_line(error: BaseException) -> str:
    """``Type: first line of the message``, at most 300 characters."""
    message = str(error).strip().splitlines()
    line = f"{type(error).__name__}: {message[0]}" if message else type(error).__name__
    return line if len(line) <= 300 else line[:297] + "..."


def record_failure(error: BaseException, *, shown: str, tb=None) -> None:
    """Write this rank's failure to its error file, if the launcher gave one and nothing is
    there yet. ``shown``: what this process printed of it, "traceback" or "message"."""
    path = os.environ.get(ERROR_FILE_ENV) or os.environ.get(TORCHRUN_ERROR_FILE_ENV)
    if not path or os.path.exists(path):
        return
    now = time.time()
    info = {"timestamp": str(int(now)),
            "meshtrain": {"time": now, "lost_peer": lost_peer(error), "shown": shown}}
    if shown == "traceback":  # (torchrun's report prints it; a message alone otherwise)
        info["py_callstack"] = "".join(traceback.format_exception(type(error), error, tb))
    try:
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump({"message": {"message": error_line(error), "extraInfo": info}}, f)
        os.replace(tmp, path)
    except OSError:  # the launcher's folder is gone: it will report the exit code alone
        pass


def record_stall(message: str, ranks: list[int]) -> None:
    """The stall watchdog stopped the job: ``ranks`` stopped advancing (``message`` says how);
    written to this rank's error file, if the launcher gave one and nothing is there yet."""
    path = os.environ.get(ERROR_FILE_ENV) or os.environ.get(TORCHRUN_ERROR_FILE_ENV)
    if not path or os.path.exists(path):
        return
    now = time.time()
    info = {"timestamp": str(int(now)), "meshtrain": {
        "time": now, "lost_peer": False, "shown": "message",
        "stall": {"ranks": list(ranks), "cause": message}}}
    try:
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump({"message": {"message": f"StallWatchdog: {message}",
                                   "extraInfo": info}}, f)
        os.replace(tmp, path)
    except OSError:
        pass


def read_record(path) -> dict | None:
    """(message, time, lost_peer, shown, traceback, stall) of a rank's error file, or None;
    ``stall``: {"ranks", "cause"} when the stall watchdog stopped the job."""
    try:
        with open(path) as f:
            data = json.load(f)["message"]
        ours = data["extraInfo"].get("meshtrain", {})
        stall = ours.get("stall")
        return {"message": data["message"], "time": float(ours.get("time",
                data["extraInfo"].get("timestamp", 0))),
                "lost_peer": bool(ours.get("lost_peer", False)),
                "shown": ours.get("shown", "traceback"),
                "traceback": data["extraInfo"].get("py_callstack"),
                "stall": stall if isinstance(stall, dict) and stall.get("ranks") else None}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


@dataclass
class Failure:
    """One rank that ended badly: its exit code (negative: the signal) and its record."""

    rank: int
    exitcode: int
    record: dict | None = None
    stopped: bool = False  # ended by the launcher itself (its SIGTERM), after another failure
    stall: str | None = None  # the stall watchdog's finding, when it stopped the job

    def how(self) -> str:
        if self.stall is not None:
            named = self.record is not None and self.record.get("stall") is not None and \
                self.rank in self.record["stall"]["ranks"]
            return "stalled" if named else "was stopped by the stall watchdog"
        if self.exitcode < 0:
            return f"was killed by signal {_signal_name(-self.exitcode)}"
        return f"exited with code {self.exitcode}"

    def what(self, where: str = "above") -> str:
        """Its error, and where its traceback or message is: the end of a sentence after
        :meth:`how` (``f"rank 1 {f.how()} first{f.what()}"``)."""
        if self.stall is not None:
            return f": {self.stall}"
        if self.record is not None:
            return f": {self.record['message']} (its {self.record['shown']} is {where})"
        if self.exitcode == -signal.SIGKILL:
            return ("; it printed no error: SIGKILL comes from outside the job (`kill -9`, the "
                    "out-of-memory killer: see `dmesg`, or a scheduler)")
        return f"; it recorded no Python error (whatever it printed is {where})"


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"number {number}"


def first_failure(failures: list[Failure]) -> Failure | None:
    """The failure the others followed from (see the module's doc), or None if there is none."""
    stalls = [f for f in failures if f.record is not None and f.record.get("stall")]
    if stalls:  # the ranks the watchdog named, if the launcher knows them, else its finder
        finder = min(stalls, key=lambda f: f.record["time"])
        stall = finder.record["stall"]
        by_rank = {f.rank: f for f in failures}
        named = [by_rank[r] for r in stall["ranks"] if r in by_rank]
        first = named[0] if named else finder
        return Failure(first.rank, first.exitcode, finder.record, first.stopped,
                       stall=stall["cause"])

    def rank_of(f: Failure):
        if f.exitcode < 0 and f.record is None and not f.stopped:
            return (0, 0.0, f.rank)  # killed from outside
        if f.record is not None and not f.record["lost_peer"]:
            return (1, f.record["time"], f.rank)
        if f.record is None and f.exitcode > 0:
            return (2, 0.0, f.rank)
        if f.record is not None:
            return (3, f.record["time"], f.rank)
        return (4, 0.0, f.rank)  # stopped by the launcher

    return min(failures, key=rank_of, default=None)
