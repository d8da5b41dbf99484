"""``Trainer(devices=N)`` in a script started with plain ``python script.py``: the first process
becomes rank 0 and starts ranks 1..N-1 by running the same command again. Every rank then runs
the script from the top, exactly as under ``torchrun``; a rank that fails stops the whole job
with a non-zero exit. (Functions on N processes from a notebook or test: ``spawn.run_workers``.)
"""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta

from meshtrain.errors import ConfigError, WorkerFailed
from meshtrain.launch.spawn import _host_store, _state, _worker_environ


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
        self.failed: tuple[int, int] | None = None
        self.procs: list[subprocess.Popen] = []
        for rank in range(1, world_size):
            env = _worker_environ(rank, world_size, self.store.port)
            self.procs.append(subprocess.Popen(command, env=env, start_new_session=True))
        os.environ.update(_worker_environ(0, world_size, self.store.port))
        self._stop = threading.Event()
        self._watcher = threading.Thread(target=self._watch, daemon=True, name="meshtrain-workers")
        self._watcher.start()
        atexit.register(self.join)  # in case no process group is ever created
        _state["workers"] = self

    def _watch(self) -> None:
        while not self._stop.wait(0.2):
            for rank, proc in enumerate(self.procs, start=1):
                code = proc.poll()
                if code not in (None, 0):
                    self.failed = (rank, code)
                    print(
                        f"meshtrain: worker rank {rank} exited with code {code} (its traceback is "
                        "above); stopping the job.",
                        file=sys.stderr,
                        flush=True,
                    )
                    self.terminate()
                    # Rank 0 normally fails fast on the broken connection; if it is stuck
                    # elsewhere, give it a moment to report, then end the job.
                    time.sleep(10)
                    os._exit(1)

    def terminate(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass

    def join(self) -> None:
        """Wait for the other ranks to finish the script; exit non-zero if any failed."""
        if self._stop.is_set():
            return
        exc = sys.exc_info()[1]
        if exc is not None:
            self._stop.set()
            self.terminate()
            return
        for proc in self.procs:
            proc.wait()
        self._stop.set()
        bad = [(r, p.returncode) for r, p in enumerate(self.procs, 1) if p.returncode != 0]
        if bad:
            print(f"meshtrain: worker ranks failed: {bad}", file=sys.stderr, flush=True)
            os._exit(1)

    def raise_if_failed(self, error: BaseException) -> None:
        """Turn a broken-connection error on rank 0 into the real cause, a failed worker."""
        self._stop.set()
        # A worker that failed by itself may still be exiting: wait for it before stopping the
        # others, so that a worker stopped here (SIGTERM) is never blamed for rank 0's own error.
        for _ in range(30):
            codes = [p.poll() for p in self.procs]
            if self.failed or any(c not in (None, 0) for c in codes) or None not in codes:
                break
            time.sleep(0.1)
        failed = self.failed or next(
            ((r, p.returncode) for r, p in enumerate(self.procs, 1) if p.returncode), None
        )
        self.terminate()
        for _ in range(20):
            if all(p.poll() is not None for p in self.procs):
                break
            time.sleep(0.1)
        if failed:
            raise WorkerFailed(
                f"worker rank {failed[0]} exited with code {failed[1]}; its traceback is above"
            ) from error
