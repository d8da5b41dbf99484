"""This process's place in the job: the other processes, the process group and the device."""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from meshtrain.errors import ConfigError
from meshtrain.launch.network import choose_interfaces
from meshtrain.launch.script_workers import ScriptWorkers
from meshtrain.launch.spawn import DistEnv, _state, init_process_group


@dataclass
class World:
    rank: int
    device: torch.device
    env: DistEnv | None
    workers: ScriptWorkers | None  # the processes started from a plain `python script.py`
    server: int | None = None  # ps=S: which parameter server this process is (no group)
    store: object = None  # ps=S: the job's store, which the servers reach too
    notes: str = ""  # printed at start: torch threads and why (threads_per_process), the network


def resolve_world_size(devices, env: DistEnv | None, device_type: str) -> int:
    """How many processes the job has: the launcher's, or ``devices`` on this machine."""
    if env is not None:
        if devices not in ("auto", 1, env.world_size):
            raise ConfigError(f"Trainer(devices={devices}) but the launcher started "
                              f"{env.world_size} processes; make them agree or use devices='auto'")
        return env.world_size
    if devices == "auto":
        return torch.cuda.device_count() if device_type == "cuda" else 1
    if device_type == "cuda" and devices > torch.cuda.device_count():
        raise ConfigError(f"devices={devices} but only {torch.cuda.device_count()} GPUs are "
                          "visible")
    return devices


def available_cores() -> int:
    """The CPUs this process may run on (its affinity set: a container's or Slurm's share, not
    the machine's), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # no affinity on this platform (macOS)
        return max(1, os.cpu_count() or 1)


def threads_per_process(local_processes: int, environ=None,
                        cores: int | None = None) -> tuple[int, str]:
    """(torch threads for each process on this node, why): an explicit ``OMP_NUM_THREADS``,
    else the cores available divided by the node's processes, at least 1. One rule for one
    process and for N, so that a one-process run and ``dp=N`` use the same cores."""
    environ = os.environ if environ is None else environ
    explicit = environ.get("OMP_NUM_THREADS", "").strip()
    if explicit:
        if not explicit.isdigit() or int(explicit) < 1:
            raise ConfigError(f"OMP_NUM_THREADS={explicit!r} is not a thread count; set it to a "
                              "positive integer, or unset it to let meshtrain share the cores")
        return int(explicit), "OMP_NUM_THREADS"
    cores = available_cores() if cores is None else cores
    local_processes = max(1, local_processes)
    return max(1, cores // local_processes), \
        f"{cores} core(s) / {local_processes} process(es) on this node"


def start_world(world_size: int, env: DistEnv | None, device_type: str, *,
                init_timeout_s: float, debug_collectives: bool = False, log=print,
                num_servers: int = 0, collective_timeout_s: float | None = None) -> World:
    """Start the other processes if needed (a plain script becomes rank 0), pick the device
    and create the default process group (gloo on CPU, NCCL on GPU). With ``num_servers``
    (layout ps=S) the last S processes are parameter servers: in no process group, only in the
    RPC world that every process then joins (meshtrain/parallel/ps/layout.py). The notes
    printed at start say the threads, the network and, with several processes, the timeouts."""
    workers = None
    if world_size > 1 and env is None:
        _refuse_after_one_process_fit(world_size)
        workers = ScriptWorkers(world_size, timedelta(seconds=init_timeout_s))
        env = DistEnv.from_environ()
    local_rank = env.local_rank if world_size > 1 else 0
    threads, why = threads_per_process(env.local_world_size if env is not None else 1)
    torch.set_num_threads(threads)
    notes = f"threads: {threads} per process ({why})"
    if world_size > 1:  # before any process group or RPC world listens
        notes += "\n" + choose_interfaces(os.environ.get("MASTER_ADDR") or "127.0.0.1")
        notes += "\n" + timeouts_note(init_timeout_s, collective_timeout_s)
    device = torch.device("cpu")
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    if world_size == 1:
        if env is None:
            _state["one_process_fit"] = True
        return World(0, device, env, workers, notes=notes)
    if num_servers:
        return _start_ps_world(world_size, num_servers, env, device, workers,
                               timedelta(seconds=init_timeout_s), "nccl" if device_type == "cuda"
                               else "gloo", notes)
    if debug_collectives and dist.is_initialized():
        if dist.get_debug_level() != dist.DebugLevel.DETAIL:  # (the checks' level)
            raise ConfigError(
                "debug_collectives=True wraps the process groups as they are created, and the "
                "default group exists already (made before this fit: by init_process_group or "
                "an earlier fit in this process), so it would check nothing; let the Trainer "
                "create the group (a fresh process), or set TORCH_DISTRIBUTED_DEBUG=DETAIL "
                "before init_process_group")
    if not dist.is_initialized():
        if debug_collectives:
            from meshtrain.fault.desync import enable_collective_checks

            enable_collective_checks()
            if env.rank == 0:
                log("debug_collectives: every collective is first checked across ranks (a few "
                    "ms each); use it to find a desync, not for speed")
        # long enough for start-up and the first step; shortened after it
        init_process_group(env, "nccl" if device_type == "cuda" else "gloo",
                           timedelta(seconds=init_timeout_s))
    return World(env.rank, device, env, workers, notes=notes)


def timeouts_note(init_timeout_s: float, collective_timeout_s: float | None) -> str:
    """What the ranks wait for at most, said at start."""
    after = f", then {collective_timeout_s:.0f} s (collective_timeout_s)" \
        if collective_timeout_s is not None else ""
    return (f"timeouts: a rank waits {init_timeout_s:.0f} s for the others to start and for "
            f"a collective of the first step (init_timeout_s){after}")


def _refuse_after_one_process_fit(world_size: int) -> None:
    """Trainer(devices=N) starts ranks 1..N-1 by running the script again from the top, so they
    would meet a one-process fit that this process ran earlier as their first Trainer, and join
    this job there: collectives out of step (a broken connection, or worse, a wrong match)."""
    if _state.get("one_process_fit"):
        raise ConfigError(
            f"this script already trained in one process (an earlier fit) and now asks for "
            f"devices={world_size}: the other {world_size - 1} process(es) start by running the "
            "script again from the top, so they would join this job at that earlier fit, out "
            "of step with it. Run the one-process fit and the devices="
            f"{world_size} fit as separate runs of the script (e.g. chosen by a command-line "
            f"argument), or give both devices={world_size}; from one Python process, "
            f"meshtrain.launch.spawn.run_workers(fn, {world_size}) runs a function on "
            f"{world_size} fresh processes.")


def _start_ps_world(world_size, num_servers, env, device, workers, timeout, backend,
                    notes: str) -> World:
    from meshtrain.launch.spawn import job_store, register_shutdown
    from meshtrain.parallel.ps.layout import join_workers

    store = job_store(env, timeout)
    num_workers = world_size - num_servers
    if env.rank >= num_workers:  # a server: answers RPCs on the CPU
        register_shutdown()
        return World(env.rank, torch.device("cpu"), env, workers, env.rank - num_workers, store,
                     notes)
    if not dist.is_initialized():
        local = min(env.local_world_size, num_workers)
        init_process_group(DistEnv(env.rank, env.local_rank, num_workers, local), backend,
                           timeout, store=dist.PrefixStore("workers", store))
    join_workers(store, env.rank, world_size)
    return World(env.rank, device, env, workers, None, store, notes)


def collective_checks(enabled: bool):
    """Under ``debug_collectives``: every collective is first compared across ranks."""
    if not (enabled and dist.is_initialized()):
        return contextlib.nullcontext()
    from meshtrain.fault.desync import collective_check_context

    return collective_check_context()


def drain_collectives() -> None:
    """Let every rank finish before objects holding collectives (DDP, ZeRO) can be freed: in
    torch 2.13 freeing DDP while a gloo worker thread still finishes a backward-time collective
    can deadlock (seen about 1 run in 10 without this)."""
    if dist.is_initialized():
        dist.barrier()
        time.sleep(0.05)
