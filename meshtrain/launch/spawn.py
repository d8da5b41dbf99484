"""Starting local worker processes without a launcher.

Two ways in:

* ``Trainer(devices=N)`` in a script started with plain ``python script.py``: the first process
  becomes rank 0 and starts ranks 1..N-1 by running the same command again
  (``launch/script_workers.py``). Every rank then runs the script from the top, exactly as under
  ``torchrun``. A rank that fails stops the whole job with a non-zero exit.
* :func:`run_workers` runs a picklable function on N fresh processes (forks of a fork server
  with torch imported) and returns what each rank returned (used by the tests and benchmarks;
  works in notebooks too).

In both, the launching process hosts the c10d ``TCPStore`` on a port the OS picks (no race for
a free port) and workers join it as clients.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import pickle
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from meshtrain.errors import ConfigError, WorkerFailed

STORE_ENV = "MESHTRAIN_STORE"  # "host:port" of a store hosted by the launching process
ROUND_ENV = "MESHTRAIN_RDZV_ROUND"  # the c10d rendezvous round, set by `meshtrain run`
NNODES_ENV = "MESHTRAIN_NNODES"  # its --nnodes (N or MIN:MAX), set by `meshtrain run`
RESTART_COUNT_ENV = "TORCHELASTIC_RESTART_COUNT"  # set by torchrun for its workers: 0, 1, ...


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in the job, read from the environment torchrun (or we) set."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    nodes: int = 1  # the launcher's agents (torchrun's GROUP_WORLD_SIZE): one per node

    @classmethod
    def from_environ(cls) -> DistEnv | None:
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            return None
        world = int(os.environ["WORLD_SIZE"])
        return cls(
            rank=int(os.environ["RANK"]),
            local_rank=int(os.environ.get("LOCAL_RANK", os.environ["RANK"])),
            world_size=world,
            local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", world)),
            nodes=int(os.environ.get("GROUP_WORLD_SIZE", 1)),
        )


def restart_count() -> int:
    """How many times torchrun (``--max-restarts``) has restarted this job's workers; 0 if none.

    0 on the first attempt and outside torchelastic. A Trainer that sees more than 0 was
    restarted after a failure and resumes from the latest complete checkpoint of its run.
    """
    return int(os.environ.get(RESTART_COUNT_ENV) or 0)


def init_process_group(env: DistEnv, backend: str, timeout: timedelta, store=None) -> None:
    """Create the default process group for ``env``.

    From the store given, else the job's (:func:`job_store`: our own launcher's, torchelastic's
    namespaced per restart attempt, or one rank 0 hosts at MASTER_ADDR:MASTER_PORT). Before the
    group, every rank joins the store (launch/waits.py): rank 0 says within seconds which ranks
    it waits for, and a rank missing after ``timeout`` is named.
    """
    import torch.distributed as dist

    from meshtrain.launch.waits import address, join

    if store is None:
        store = job_store(env, timeout)
    if env.world_size > 1:
        _state["joins"] = _state.get("joins", 0) + 1
        join(store, env.rank, env.world_size, timeout.total_seconds(), where=address(store),
             generation=_state["joins"])
    if "nccl" in backend:
        flight_recorder_defaults(os.environ)
    dist.init_process_group(
        backend, store=store, rank=env.rank, world_size=env.world_size, timeout=timeout
    )
    register_shutdown()


#: NCCL's flight recorder (what torchtitan turns on): the last collectives of every rank kept
#: in a ring buffer and dumped to files when a collective times out, the first thing to read
#: after a hang (``python -m torch.distributed.flight_recorder.fr_trace DIR``). Set unless the
#: environment sets them (TORCH_NCCL_TRACE_BUFFER_SIZE=0 turns it off).
FLIGHT_RECORDER = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "20000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
                   "TORCH_FR_DUMP_TEMP_FILE": os.path.join("flight_recorder", "rank_")}


def flight_recorder_defaults(environ, run_dir=None) -> None:
    """Turn NCCL's flight recorder on in ``environ`` where it says nothing of it; its dumps go
    to ``run_dir/flight_recorder/`` (once the run folder is known: torch reads the path when it
    dumps), else ``./flight_recorder/``."""
    for name, value in FLIGHT_RECORDER.items():
        environ.setdefault(name, value)
    if run_dir is not None and environ["TORCH_FR_DUMP_TEMP_FILE"] == FLIGHT_RECORDER[
            "TORCH_FR_DUMP_TEMP_FILE"]:
        environ["TORCH_FR_DUMP_TEMP_FILE"] = os.path.join(run_dir, "flight_recorder", "rank_")
        os.makedirs(os.path.join(run_dir, "flight_recorder"), exist_ok=True)


def register_shutdown() -> None:
    """End this process as :func:`_shutdown` says (once per process)."""
    from meshtrain.launch.endings import install

    if not _state["hooked"]:
        atexit.register(_shutdown)
        _state["hooked"] = True
    install()


def job_store(env: DistEnv, timeout: timedelta):
    """The job's key-value store: our launcher's (``MESHTRAIN_STORE``), torchelastic's (per
    restart attempt), or else one that rank 0 hosts at MASTER_ADDR:MASTER_PORT (as env://). A
    client waits for it saying so (launch/waits.py)."""
    from meshtrain.launch.waits import connect

    if STORE_ENV in os.environ:
        host, port = os.environ[STORE_ENV].rsplit(":", 1)
        return connect(host, int(port), env.world_size, timeout,
                       who="the store of the process that started this one",
                       fix=f"it has ended; {STORE_ENV} points at it")
    if RESTART_COUNT_ENV in os.environ:
        return _attempt_store(env, timeout)
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not host or not port:
        raise ConfigError("MASTER_ADDR/MASTER_PORT are not set: start the script with torchrun, "
                          "`meshtrain run`, or Trainer(devices=N) from a plain script")
    return _rank0_store(host, int(port), env, timeout)


def _attempt_store(env: DistEnv, timeout: timedelta):
    """The torchelastic job's store at MASTER_ADDR:MASTER_PORT, namespaced per restart attempt.

    With torchrun's c10d rendezvous (what `meshtrain run` uses) the workers' store is the agent's
    rendezvous store, which lives for the whole job: every restart attempt would write its
    process-group keys (gloo's peer addresses among them) under the same names as the attempts
    before it, and a restarted rank could read a dead rank's address (hangs, `Connection
    refused`; see /work/shared/notes/torch-2.13-cpu-gloo.md). ``attempt_{N}/`` keeps each
    attempt's keys apart. torchrun sets TORCHELASTIC_USE_AGENT_STORE=True when its agent hosts
    that store (the workers join as clients); otherwise rank 0 hosts it, as env:// does.
    """
    import torch.distributed as dist

    host = os.environ.get("MASTER_ADDR")
    port = os.environ.get("MASTER_PORT")
    if not host or not port:
        raise ConfigError(
            f"{RESTART_COUNT_ENV} is set (a torchelastic worker) but MASTER_ADDR/MASTER_PORT are "
            "not: start the script with torchrun or `meshtrain run`"
        )
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True):
        from meshtrain.launch.waits import connect

        store = connect(host, int(port), env.world_size, timeout,
                        who="the store of this job's rank-0 node",
                        fix="its agent has ended (see its output)")
    else:
        store = _rank0_store(host, int(port), env, timeout)
    rendezvous_round = os.environ.get(ROUND_ENV)  # set by `meshtrain run` (launch/torchrun.py)
    namespace = f"round_{rendezvous_round}" if rendezvous_round else f"attempt_{restart_count()}"
    return dist.PrefixStore(namespace, store)


# ---------------------------------------------------------------------------------------------
# Shutdown. Left to interpreter teardown, a gloo/FSDP2 process sometimes aborts after all its work
# is done ("terminate called without an active exception", SIGABRT, in C++ static destructors),
# and a launcher then reports a failed job. Processes that a meshtrain launcher started therefore
# end like this: wait for the other ranks (rank 0 of Trainer(devices=N)), flush, and leave with
# os._exit, skipping those destructors. Other processes destroy the process group. The exit code
# is the one Python would have exited with (launch/endings.py), or 1 where another rank failed.
# ---------------------------------------------------------------------------------------------
LAUNCHER_ENV = "MESHTRAIN_LAUNCHER"
_state = {"workers": None, "hooked": False}


def _shutdown() -> None:
    import torch.distributed as dist

    from meshtrain.launch.endings import exit_code

    code = exit_code()
    workers = _state["workers"]
    if workers is not None:  # (stopped, unblamed, when this process fails itself)
        joined = workers.join(failing=code != 0)
        code = code or joined
    if STORE_ENV in os.environ or LAUNCHER_ENV in os.environ:
        # No destroy_process_group here: with DDP or ZeRO objects still alive it can deadlock
        # with gloo's worker threads, and os._exit leaves nothing for it to clean up.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    if dist.is_initialized():
        dist.destroy_process_group()


def _host_store(world_size: int, timeout: timedelta):
    """The store of a job on this machine, listening on 127.0.0.1 only (launch/network.py)."""
    import torch.distributed as dist

    from meshtrain.launch.network import listening_socket

    sock = listening_socket("127.0.0.1")
    return dist.TCPStore("127.0.0.1", sock.getsockname()[1], world_size, is_master=True,
                         timeout=timeout, wait_for_workers=False, master_listen_fd=sock.detach())


def _rank0_store(host: str, port: int, env: DistEnv, timeout: timedelta):
    """The job's store at host:port, hosted by rank 0 on ``host``'s own address (not on every
    interface, as torch would), joined by the others: they wait for it saying so, and rank 0
    does not wait in the store's constructor (silently) but in :func:`init_process_group`'s
    join, which names the ranks it waits for."""
    import torch.distributed as dist

    if env.rank != 0:
        from meshtrain.launch.waits import connect

        return connect(host, port, env.world_size, timeout,
                       who="the store rank 0 hosts (MASTER_ADDR:MASTER_PORT)",
                       fix="is rank 0 started, and do all ranks have the same MASTER_ADDR and "
                       "MASTER_PORT?")
    from meshtrain.launch.network import listening_socket

    sock = listening_socket(host, port)
    return dist.TCPStore(host, port, env.world_size, is_master=True, timeout=timeout,
                         multi_tenant=True, wait_for_workers=False,
                         master_listen_fd=sock.detach())


def _worker_environ(rank: int, world_size: int, store_port: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(store_port),
        **{STORE_ENV: f"127.0.0.1:{store_port}"},
    )
    return env


# ---------------------------------------------------------------------------------------------
# run_workers(fn, N): a function on N fresh processes
# ---------------------------------------------------------------------------------------------
# Modules the fork server imports once; every worker starts as a fork of it, with them loaded.
# (A test suite may add its own before the first run_workers call; see tests/conftest.py.)
FORKSERVER_PRELOAD = ["torch", "torch.distributed", "meshtrain.launch.worker_imports"]


def _run_one(fn, args, environ: dict, cwd: str, rank: int, out_dir: str, threads: int):
    # a fork of the fork server: take the launching process's environment and folder, as a
    # freshly spawned process would
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    for fd, stream in ((1, "out"), (2, "err")):  # the launching process relays them (_Relay)
        target = os.open(Path(out_dir) / f"rank{rank}.{stream}", os.O_WRONLY | os.O_CREAT, 0o600)
        os.dup2(target, fd)
        os.close(target)
    import torch

    from meshtrain.launch.fork_guard import threads_at_fork

    torch.set_num_threads(threads)
    result_path = Path(out_dir) / f"rank{rank}.pkl"
    if len(threads_at_fork) > 1:  # (an assert: nothing a user did; see fork_guard.py)
        result_path.write_bytes(pickle.dumps(("error", (
            f"the fork server had {len(threads_at_fork)} threads ({', '.join(threads_at_fork)}) "
            "when it forked this worker: its heap may be corrupt. A module in "
            "FORKSERVER_PRELOAD started them; leave it out or start its threads lazily"))))
        os._exit(1)
    try:
        value = fn(*args)
    except BaseException:
        result_path.write_bytes(pickle.dumps(("error", traceback.format_exc())))
        # multiprocessing catches the exception (no sys.excepthook): without this, _shutdown's
        # os._exit would report success and run_workers would wait for the others to finish
        from meshtrain.launch.endings import mark_uncaught

        mark_uncaught()
        raise
    result_path.write_bytes(pickle.dumps(("ok", value)))


class _Relay:
    """Copies what the workers write to their stdout and stderr (files in ``out_dir``) to this
    process's, as it comes: a fork of the fork server does not share this process's streams."""

    def __init__(self, out_dir: str, num_workers: int):
        self.files = [(Path(out_dir) / f"rank{r}.{s}", fd)
                      for r in range(num_workers) for s, fd in (("out", 1), ("err", 2))]
        self.offsets = [0] * len(self.files)

    def pump(self) -> None:
        for i, (path, fd) in enumerate(self.files):
            try:
                with open(path, "rb") as f:
                    f.seek(self.offsets[i])
                    data = f.read()
            except FileNotFoundError:
                continue
            if data:
                self.offsets[i] += len(data)
                os.write(fd, data)


@contextlib.contextmanager
def _server_environ():
    """The environment the fork server starts with (on the first ``start``): one OpenMP thread.
    With OMP_NUM_THREADS unset, importing torch starts an OpenMP pool (cores - 1 threads), and
    a fork of a process with a live GNU OpenMP pool may crash or hang (heap corruption:
    "malloc(): unaligned tcache chunk detected"). The server never computes; each worker sets
    its own count (``_run_one``) and takes the launching process's environment back."""
    before = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ["OMP_NUM_THREADS"]
        else:
            os.environ["OMP_NUM_THREADS"] = before


def run_workers(fn, num_workers: int, args: tuple = (), *, timeout: float = 120.0, threads: int = 1):
    """Run ``fn(*args)`` on ``num_workers`` new processes (ranks 0..N-1); return their results.

    Each process sees RANK/WORLD_SIZE like under torchrun, so ``Trainer`` joins the job. A worker
    that raises makes this raise ``WorkerFailed`` with its traceback; one that runs past
    ``timeout`` seconds makes all of them be killed (a hang fails instead of blocking).

    Workers are forks of a fork server (``multiprocessing``'s "forkserver") that has imported
    :data:`FORKSERVER_PRELOAD` once: starting one costs milliseconds instead of importing torch
    again (seconds). Like spawned processes they share nothing with this one but what they are
    given: ``fn``, ``args``, this process's environment and working folder.
    """
    import multiprocessing as mp

    if num_workers < 1:
        raise ConfigError(f"num_workers must be at least 1, got {num_workers}")
    ctx = mp.get_context("forkserver")
    # (no effect once the server runs); fork_guard last: it checks the server forks alone
    ctx.set_forkserver_preload([*FORKSERVER_PRELOAD, "meshtrain.launch.fork_guard"])
    store = _host_store(num_workers, timedelta(seconds=timeout))
    with tempfile.TemporaryDirectory(prefix="meshtrain-") as out_dir:
        procs = [
            ctx.Process(
                target=_run_one,
                args=(fn, args, _worker_environ(rank, num_workers, store.port), os.getcwd(),
                      rank, out_dir, threads),
                daemon=True,
            )
            for rank in range(num_workers)
        ]
        with _server_environ():
            for proc in procs:
                proc.start()
        relay = _Relay(out_dir, num_workers)
        deadline = time.monotonic() + timeout
        try:
            while any(p.is_alive() for p in procs):
                relay.pump()
                if any(p.exitcode not in (None, 0) for p in procs):
                    time.sleep(2.0)  # let the others notice and write their errors
                    break
                if time.monotonic() > deadline:
                    raise WorkerFailed(
                        f"workers did not finish within {timeout:.0f} s (hang?); killed them"
                    )
                time.sleep(0.05)
        finally:
            for proc in procs:
                if proc.is_alive():
                    proc.kill()
                proc.join()
            relay.pump()
        results, errors = [], []
        for rank, proc in enumerate(procs):
            path = Path(out_dir) / f"rank{rank}.pkl"
            if not path.exists():
                errors.append(f"rank {rank}: exited with code {proc.exitcode} and no result")
                results.append(None)
                continue
            status, value = pickle.loads(path.read_bytes())
            if status == "error":
                errors.append(f"rank {rank} raised:\n{value}")
                results.append(None)
            else:
                results.append(value)
        if errors:
            raise WorkerFailed("\n".join(errors))
        return results
