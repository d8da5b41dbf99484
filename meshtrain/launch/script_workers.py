"""``Trainer(devices=N)`` in a script started with plain ``python script.py``: the first process
becomes rank 0 and starts ranks 1..N-1 by running the same command again. Every rank then runs
the script from the top, exactly as under ``torchrun``; a rank that fails stops the whole job
with a non-zero exit, and rank 0 names the rank that failed first and its error (each rank
records its failure in a file of its own: launch/endings.py). (Functions on N processes from a
notebook or test: ``spawn.run_workers``.)
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path

from meshtrain.errors import ConfigError, WorkerFailed
from meshtrain.launch import endings
from meshtrain.launch.endings import Failure
from meshtrain.launch.spawn import _host_store, _state, _worker_environ

STALL_GRACE_S = 60.0  # a worker the stall watchdog stopped: rank 0's watchdog ends the job


def script_command() -> list[str]:
    """The command that started this process, to run it again for the other ranks."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    argv0 = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    refuse = ConfigError(
        "Trainer(devices=N) starts the other workers by running this script again, but this "
        f"process was not started as a script ({argv0 or 'interactive'}). Run it as "
        "`python your_script.py`, launch it with `meshtrain run --nproc-per-node N script.py`, "
        "or use meshtrain.launch.spawn.run_workers(fn, N) from a notebook or test."
    )
    if spec is not None and spec.name:
        name = spec.name.removesuffix(".__main__")
        if name in ("pytest", "ipykernel_launcher", "IPython"):
            raise refuse
        return [sys.executable, "-m", name, *sys.argv[1:]]
    if not getattr(main, "__file__", None) or argv0 in ("pytest", "py.test", "-c", ""):
        raise refuse
    return [sys.executable, os.path.abspath(sys.argv[0]), *sys.argv[1:]]


class ScriptWorkers:
    """Ranks 1..N-1 started by rank 0, watched by a thread that stops the job if one fails."""

    def __init__(self, world_size: int, timeout: timedelta):
        command = script_command()
        self.store = _host_store(world_size, timeout)
        self.world_size = world_size
        self.errors = Path(tempfile.mkdtemp(prefix="meshtrain-errors-"))  # rank{r}.json
        self.failed: Failure | None = None  # the first worker the watcher saw fail
        self.stopped = False  # terminate() sent them SIGTERM
        self._joined = False
        self.procs: list[subprocess.Popen] = []
        for rank in range(1, world_size):
            env = self._environ(rank)
            self.procs.append(subprocess.Popen(command, env=env, start_new_session=True))
        os.environ.update(self._environ(0))
        endings.install()  # (this process's exit code and error, also before any process group)
        self._stop = threading.Event()
        self._watcher = threading.Thread(target=self._watch, daemon=True, name="meshtrain-workers")
        self._watcher.start()
        atexit.register(self._join_at_exit)  # in case no process group is ever created
        _state["workers"] = self

    def _environ(self, rank: int) -> dict[str, str]:
        env = _worker_environ(rank, self.world_size, self.store.port)
        env[endings.ERROR_FILE_ENV] = str(self.errors / f"rank{rank}.json")
        return env

    def failures(self) -> list[Failure]:
        """The workers that have ended badly so far, with what they recorded."""
        return [Failure(rank, code, endings.read_record(self.errors / f"rank{rank}.json"),
                        stopped=self.stopped and code == -signal.SIGTERM)
                for rank, code in ((r, p.poll()) for r, p in enumerate(self.procs, 1))
                if code not in (None, 0)]

    def _watch(self) -> None:
        stall_seen = None
        while not self._stop.wait(0.2):
            first = endings.first_failure(self.failures())
            if first is not None and first.stall is not None and (
                    stall_seen is None or time.monotonic() - stall_seen < STALL_GRACE_S):
                # the stall watchdog stops every rank, this one too, and records the ending
                stall_seen = stall_seen or time.monotonic()
                continue
            if first is not None:
                self.failed = first
                print(f"meshtrain: worker rank {first.rank} {first.how()}{first.what()}; "
                      "stopping the job.", file=sys.stderr, flush=True)
                self.terminate()
                # Rank 0 normally fails fast on the broken connection; if it is stuck
                # elsewhere, give it a moment to report, then end the job, recording why.
                time.sleep(10)
                self._record_ending(first)
                os._exit(1)

    @staticmethod
    def _record_ending(first: Failure) -> None:
        from meshtrain.observe.ending import announced, from_failure, record_ending

        run_dir = announced()
        if run_dir is not None:
            record_ending(run_dir, **from_failure(first, "the launcher (rank 0's process)"))

    def terminate(self) -> None:
        """SIGTERM to every worker still running, and SIGCONT, so that a stopped one (SIGSTOP)
        gets it too."""
        self.stopped = True
        for proc in self.procs:
            if proc.poll() is None:
                for sig in (signal.SIGTERM, signal.SIGCONT):
                    try:
                        os.killpg(proc.pid, sig)
                    except ProcessLookupError:
                        pass

    def abandon(self) -> None:
        """This process leaves now (the stall watchdog): end the workers still running after a
        moment (the others leave at the same time), a stopped one included."""
        self._stop.set()
        self._joined = True
        if not self._wait(1.0):
            self.terminate()
        shutil.rmtree(self.errors, ignore_errors=True)

    def _wait(self, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while any(p.poll() is None for p in self.procs):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    def join(self, failing: bool = False) -> int:
        """Wait for the other ranks to finish the script; 1 if one failed (rank 0 says which
        first, and with what), else 0. ``failing``: this process fails itself; the others get
        a moment to end by themselves, then are stopped, and not blamed."""
        if self._joined:
            return 0
        self._joined = True
        failing = failing or self._stop.is_set()  # (raise_if_failed: a failure seen already)
        self._stop.set()
        try:
            if failing:
                if not self._wait(2.0):
                    self.terminate()
                    self._wait(5.0)
                return 0
            for proc in self.procs:
                proc.wait()
            first = endings.first_failure(self.failures())
            if first is None:
                return 0
            print(f"meshtrain: the job failed: worker rank {first.rank} {first.how()} first"
                  f"{first.what()}", file=sys.stderr, flush=True)
            return 1
        finally:
            shutil.rmtree(self.errors, ignore_errors=True)

    def _join_at_exit(self) -> None:
        if self.join(failing=endings.exit_code() != 0):
            os._exit(1)

    def raise_if_failed(self, error: BaseException) -> None:
        """Rank 0's ``error`` came from a worker that failed first (a broken connection after
        it died): raise WorkerFailed naming that worker and its error. Rank 0's own error (one
        that is not a lost peer) is left to its caller to raise."""
        self._stop.set()
        if not endings.lost_peer(error):  # rank 0's own error
            self.terminate()
            return
        # A worker that failed by itself may still be exiting: wait for it before stopping the
        # others, so that a worker stopped here (SIGTERM) is never blamed for rank 0's error.
        for _ in range(30):
            codes = [p.poll() for p in self.procs]
            if self.failed or any(c not in (None, 0) for c in codes) or None not in codes:
                break
            time.sleep(0.1)
        first = endings.first_failure(self.failures())
        self.terminate()
        self._wait(2.0)
        if first is not None:
            raise WorkerFailed(f"worker rank {first.rank} {first.how()} first{first.what()}") \
                from error
