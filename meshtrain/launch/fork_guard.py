"""The fork server's last import: run_workers' workers are forked from a single thread.

A fork copies only the forking thread; a lock another thread held (malloc's arenas, an OpenMP
pool, gloo) stays held forever in the child, and its heap may be caught half-updated, which is
how a worker can die with ``malloc(): unaligned tcache chunk detected``. This module, imported
after :data:`meshtrain.launch.spawn.FORKSERVER_PRELOAD` in the fork server only, keeps torch from
starting its thread pools there and records, at every fork, how many threads the server had:
the worker refuses to run if it was more than one (``_run_one``), with the names of those threads.
(What it found: with OMP_NUM_THREADS unset, ``import torch`` starts an OpenMP pool, so the server
now starts with OMP_NUM_THREADS=1: ``spawn._server_environ``.)
"""
import os
import threading

import torch

# the server never computes: an intra-op (OpenMP) or inter-op pool started here would be
# copied into every worker without its threads
torch.set_num_threads(1)

threads_at_fork: list[str] = []  # in a worker: the server's threads when it forked this one


def thread_names() -> list[str]:
    """This process's threads: Python's by name, then those C libraries started (an OpenMP
    pool, gloo), which only the kernel lists (Linux), by their kernel name."""
    names = [t.name for t in threading.enumerate()]
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:  # not Linux: Python's threads only
        return names
    native = []
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                native.append(f"native thread {f.read().strip()!r}")
        except OSError:  # ended meanwhile
            pass
    return names + native[len(names):]


_fork = os.fork


def _recording_fork():
    threads_at_fork[:] = thread_names()
    return _fork()


os.fork = _recording_fork  # multiprocessing.forkserver calls os.fork() for every worker
