"""Which rank stopped advancing, when the stall watchdog (``watchdog.py``) finds a step past its
limit: every rank's last progress compared, not the rank that noticed first.

Each rank's watchdog thread keeps its progress in the job's store (:data:`PROGRESS_KEY`: step,
in a step or between steps, pid, host; written when it changes, at most once a second). When a
stall is announced, every rank that can still run Python answers (:data:`ANSWER_KEY`) with its
step, how long it has been in it, where its main thread is, and each process group's collective
sequence number (how many collectives it has started on that group: torch's
``ProcessGroup._get_sequence_number_for_group``, readable while the main thread waits in one).
:func:`judge` then names, in this order:

1. the ranks that did not answer: stopped (SIGSTOP: state ``T`` in ``/proc/PID/status``),
   exited, or alive but unable to run their watchdog thread (a thread holding the GIL). On the
   same host their state, kernel wait channel and kernel stack are read from ``/proc``, their
   Python stack with ``py-spy dump`` when py-spy is installed, and a live one is asked for its
   stacks through faulthandler on :data:`STACK_SIGNAL` (written from C, GIL or not); a stopped
   one is ended once the finding is recorded (:func:`end_stopped`);
2. else the ranks in an earlier step than the others (or between steps while the others are in
   the next one);
3. else the ranks that have started fewer collectives on a group than its other members: the
   others wait in a collective that these have not reached;
4. else none: every rank is in the same step and has started the same collectives (a
   collective that never completes, a network or device hang, or a step slower than the limit).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import torch

PROGRESS_KEY = "meshtrain/progress/rank{}"
ANSWER_KEY = "meshtrain/stall_answer/rank{}"
STACK_SIGNAL = signal.SIGRTMIN + 4  # faulthandler writes this rank's stacks on it
PY_SPY_TIMEOUT_S = 10.0
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_STDLIB_DIR = os.path.dirname(os.__file__) + os.sep
HOST = socket.gethostname()


def progress(step: int | None, in_step: bool) -> dict:
    return {"step": step, "in_step": in_step, "pid": os.getpid(), "host": HOST,
            "time": time.time()}


def collective_sequences() -> dict[str, int]:
    """Each process group's name -> the collectives this rank has started on it."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return {}
    world = dist.distributed_c10d._world
    sequences = {}
    for group in list(world.pg_map):
        try:
            sequences[world.pg_names[group]] = int(group._get_sequence_number_for_group())
        except Exception:  # noqa: BLE001 - a backend without sequence numbers
            continue
    return sequences


def main_thread_place() -> str | None:
    """``function (file:line)`` of the innermost frame of the main thread that is neither
    torch's nor the standard library's: where the rank's own code is."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith((_TORCH_DIR, _STDLIB_DIR)) and not name.startswith("<"):
            return f"{frame.f_code.co_name} ({os.path.basename(name)}:{frame.f_lineno})"
        frame = frame.f_back
    return None


def answer(step: int | None, in_step: bool, age_s: float | None) -> dict:
    return {**progress(step, in_step), "age_s": age_s, "seqs": collective_sequences(),
            "place": main_thread_place()}


def where(info: dict | None) -> str:
    """'in step 4 (for 3.1 s)', 'between steps (after step 3)', or 'before its first step'."""
    if not info or info.get("step") is None:
        return "before its first watched step"
    if info.get("in_step"):
        age = info.get("age_s")
        return f"in step {info['step']}" + (f" (for {age:.1f} s)" if age is not None else "")
    return f"between steps (after step {info['step']})"


def _position(info: dict) -> float:
    step = info.get("step")
    if step is None:
        return -1.0
    return step if info.get("in_step") else step + 0.5


@dataclass
class Verdict:
    ranks: list[int]  # the ranks named as the ones that stopped advancing (may be empty)
    cause: str  # one sentence
    outside: dict[int, str] = field(default_factory=dict)  # what was read of silent ranks
    stopped: list[int] = field(default_factory=list)  # pids of silent ranks stopped here (T)


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def inspect_process(rank: int, info: dict | None) -> tuple[str, str]:
    """(a phrase on what the process of a rank that did not answer is doing, the text for its
    stacks file), read from outside."""
    if not info or not info.get("pid"):
        return ("its process is not known (it never reported its progress)",
                "Nothing is known of this rank's process: it never reported its progress.")
    pid, host = info["pid"], info.get("host")
    if host != HOST:
        return (f"pid {pid} on host {host}, which cannot be looked at from {HOST}",
                f"Rank {rank} runs as pid {pid} on host {host}; its state and stacks cannot be "
                f"read from {HOST}. Look there (py-spy dump --pid {pid}).")
    status = _read(f"/proc/{pid}/status")
    if status is None:
        return f"pid {pid} has exited", f"pid {pid}: no /proc/{pid}: the process has exited."
    state = next((line.split(":", 1)[1].strip() for line in status.splitlines()
                  if line.startswith("State:")), "?")
    letter = state[:1]
    phrase = {
        "T": f"its process (pid {pid}) is stopped (state T in /proc/{pid}/status: SIGSTOP or "
             "job control), so it cannot run Python",
        "t": f"its process (pid {pid}) is stopped by a debugger (state t in /proc/{pid}/status)",
        "Z": f"its process (pid {pid}) has exited (a zombie: state Z)",
        "D": f"its process (pid {pid}) is in an uninterruptible wait in the kernel (state D: "
             "I/O, a driver)",
    }.get(letter, f"its process (pid {pid}, state {state}) is alive but its watchdog thread "
                  "did not run (a thread holding the GIL?)")
    lines = [f"Rank {rank}, pid {pid} on {HOST}, read from outside by the stall watchdog of "
             "another rank:", f"state: {state}"]
    wchan = _read(f"/proc/{pid}/wchan")
    if wchan:
        lines.append(f"kernel wait channel (/proc/{pid}/wchan): {wchan}")
    stack = _read(f"/proc/{pid}/stack")
    lines.append(f"kernel stack (/proc/{pid}/stack):\n{stack}" if stack else
                 f"kernel stack: /proc/{pid}/stack is not readable here (it needs root)")
    lines.append(_python_stack(pid))
    if letter in "RS" and _catches(status, STACK_SIGNAL):
        try:  # faulthandler writes its stacks to its own file, from C
            os.kill(pid, STACK_SIGNAL)
            lines.append(f"asked it for its stacks (signal {STACK_SIGNAL}): if it could, it "
                         "wrote them below")
        except OSError as error:
            lines.append(f"could not signal it for its stacks: {error}")
    return phrase, "\n".join(lines)


def _catches(status: str, signum: int) -> bool:
    """Does the process of ``/proc/PID/status`` text ``status`` catch ``signum`` (its watchdog
    registered faulthandler on it)? Sent to one that does not, it would end it."""
    mask = next((line.split(":", 1)[1].strip() for line in status.splitlines()
                 if line.startswith("SigCgt:")), "0")
    try:
        return bool(int(mask, 16) >> (int(signum) - 1) & 1)
    except ValueError:
        return False


def end_stopped(pids: list[int]) -> None:
    """End the job's stopped processes on this host (SIGTERM, then SIGCONT so that it is
    delivered): a launcher would otherwise wait for them (torchrun: 30 s, then SIGKILL)."""
    for pid in pids:
        status = _read(f"/proc/{pid}/status") or ""
        if "State:\tT" not in status:  # (ended, or continued, since it was read)
            continue
        for sig in (signal.SIGTERM, signal.SIGCONT):
            try:
                os.kill(pid, sig)
            except OSError:
                pass


def _python_stack(pid: int) -> str:
    spy = shutil.which("py-spy")
    if spy is None:
        return ("Python stack: not read (py-spy is not installed; `pip install py-spy` lets "
                "the watchdog read a stopped rank's Python stack). A stopped process cannot "
                "write its own.")
    try:
        done = subprocess.run([spy, "dump", "--pid", str(pid)], capture_output=True, text=True,
                              timeout=PY_SPY_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"Python stack: py-spy dump --pid {pid} failed: {error}"
    text = (done.stdout or done.stderr).strip()
    return f"Python stack (py-spy dump --pid {pid}):\n{text}"


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def judge(answers: dict[int, dict], progress_of: dict[int, dict | None],
          world_size: int) -> Verdict:
    """The ranks that stopped advancing, by the rules of the module's doc. ``answers``: the
    ranks that answered (this one included); ``progress_of``: each rank's last progress."""
    silent = [r for r in range(world_size) if r not in answers]
    by_place: dict[str, list[int]] = {}
    for rank, info in sorted(answers.items()):
        by_place.setdefault(where({**info, "age_s": None}), []).append(rank)
    waiting = "the others wait: " + "; ".join(
        f"{_ranks(ranks)} {'is' if len(ranks) == 1 else 'are'} {place}"
        for place, ranks in by_place.items()) if by_place else ""
    if silent:
        parts, outside = [], {}
        stopped = []
        for rank in silent:
            phrase, outside[rank] = inspect_process(rank, progress_of.get(rank))
            if "(state T in" in phrase:
                stopped.append(progress_of[rank]["pid"])
            parts.append(f"rank {rank} did not answer: {phrase}; last heard of "
                         f"{where(progress_of.get(rank))}")
        return Verdict(silent, "; ".join(parts) + (f"; {waiting}" if waiting else ""), outside,
                       stopped)
    positions = {r: _position(a) for r, a in answers.items()}
    if len(set(positions.values())) > 1:
        low = min(positions.values())
        behind = sorted(r for r, p in positions.items() if p == low)
        ahead = sorted({where({**a, "age_s": None}) for r, a in answers.items()
                        if r not in behind})
        return Verdict(behind, f"{_ranks(behind)} is behind: it is {where(answers[behind[0]])}"
                       f"{_place(answers[behind[0]])}, while the others are "
                       f"{' / '.join(ahead)}")
    behind_on: dict[int, list[str]] = {}
    groups = {name for a in answers.values() for name in a.get("seqs", {})}
    for name in sorted(groups):
        seqs = {r: a["seqs"][name] for r, a in answers.items() if name in a.get("seqs", {})}
        top = max(seqs.values())
        for rank, seq in seqs.items():
            if seq < top:
                behind_on.setdefault(rank, []).append(
                    f"{seq} collectives on group {name}, the others {top}")
    if behind_on:
        behind = sorted(behind_on)
        first = behind[0]
        return Verdict(behind, f"{_ranks(behind)} stopped before a collective the others wait "
                       f"in: it is {where(answers[first])}{_place(answers[first])} and has "
                       f"started {'; '.join(behind_on[first])}")
    step = where(next(iter(answers.values())))
    return Verdict([], f"no rank is behind: every rank is {step} and has started the same "
                   "collectives (a collective that never completes, a network or device hang, "
                   "or a step slower than the limit)")


def _place(info: dict) -> str:
    return f" in {info['place']}" if info.get("place") else ""


def read_json_key(store, key: str) -> dict | None:
    try:
        if not store.check([key]):
            return None
        value = json.loads(store.get(key).decode())
    except Exception:  # noqa: BLE001 - the store's host is gone, or a torn value
        return None
    return value if isinstance(value, dict) else None
