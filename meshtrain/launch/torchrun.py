"""`meshtrain run`: a thin front over torchrun (`torch.distributed.run`), run in this process.

It takes torchrun's own flags and adds three things: on one node it picks a free port on
127.0.0.1 by itself, it checks the script and the port before any worker starts, and a worker
failure ends in a short summary and exit code 1 instead of a long Python traceback.

Fault tolerance (`--max-restarts K`): when a worker fails, torchrun stops all workers and
starts them again, up to K times; `meshtrain run` says so once when it starts, and after the
job how many restarts there were. With gloo, restarted ranks used to read stale addresses from
the rendezvous store, which torchrun's c10d rendezvous shares between attempts (see
/work/shared/notes/torch-2.13-cpu-gloo.md: hangs and `Connection refused`; measured here 3 of
12 runs recovered with plain `init_process_group("gloo")`). Workers that create their process
group through meshtrain (`meshtrain.launch.spawn.init_process_group`, which the Trainer uses)
use that store namespaced per attempt (12 of 12 recovered): by the rendezvous round, which
`meshtrain run` gives its workers (launch/rendezvous.py), so that nodes that restarted for
different reasons (a failure, a node lost or joining under `--nnodes MIN:MAX`) still agree.
Setting `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1` only helped with c10d rendezvous, so it is not
set here. torchrun 2.13 checks its workers every 0.1 s (`--monitor-interval`), so a restart
starts new workers 0.2-0.6 s after a failure; their start-up (importing torch) takes the
seconds after it.

SIGUSR1 and SIGUSR2 are passed on to the workers (the Trainer's `stop_on_signal`) instead of
ending the agent: Slurm's `--signal` and `scancel --signal` reach this process.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import ipaddress
import os
import shutil
import signal
import sys
import tempfile
import uuid
from collections.abc import Iterator, Sequence

from meshtrain.errors import ConfigError
from meshtrain.fault.restarts import repeated_failures_stop_restarts
from meshtrain.launch.agent_ending import agent_records
from meshtrain.launch.ports import check_port_free, find_free_port
from meshtrain.launch.rdzv_watch import agent_watch, rendezvous_error_line, watching
from meshtrain.launch.rendezvous import LOCAL_HOST, rendezvous_store, round_in_worker_env
from meshtrain.launch.spawn import NNODES_ENV
from meshtrain.launch.world import threads_per_process

# Words torchrun accepts for --nproc-per-node besides a number ("use every device/core").
_NPROC_WORDS = ("auto", "cpu", "gpu", "xpu")


def build_parser() -> argparse.ArgumentParser:
    """torchrun's own argument parser, renamed `meshtrain run`, so every torchrun flag works."""
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.prog = "meshtrain run"
    parser.description = (
        "Start TRAINING_SCRIPT on this node's workers with torchrun. Takes torchrun's flags. "
        "On one node (no --nnodes > 1, no --rdzv-endpoint) it runs on 127.0.0.1 with a free "
        "port unless --master-port names one; OMP_NUM_THREADS defaults to the cores available "
        "divided by the workers on this node."
    )
    return parser


def run(argv: Sequence[str] | None = None) -> int:
    """Parse `argv` like torchrun, start the workers and wait; 0 if all succeeded, else 1."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.run import run as torchrun

    from meshtrain.launch.waits import WaitTimedOut

    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    prepare_args(args)
    if args.max_restarts > 0:
        print(restart_notice(args.max_restarts), file=sys.stderr, flush=True)
    # several nodes: the waits said, the agents compared, dead nodes found (launch/rdzv_watch.py)
    watch = agent_watch(args, _local_processes(args.nproc_per_node),
                        lambda: _forward_to_workers(signal.SIGTERM, None))
    if watch is not None:
        print(watch.start_line(), file=sys.stderr, flush=True)
    attempts_before = _attempt_dirs(args.log_dir)
    with _restored_process_state(args.signals_to_handle):
        # the Trainer's rule (launch/world.py), set here: torchrun sets 1 when it is unset
        os.environ.setdefault("OMP_NUM_THREADS",
                              str(threads_per_process(_local_processes(args.nproc_per_node))[0]))
        # Workers that create their group through meshtrain end cleanly (see launch/spawn.py).
        os.environ["MESHTRAIN_LAUNCHER"] = "torchrun"
        os.environ[NNODES_ENV] = str(args.nnodes)  # N or MIN:MAX, for the workers' messages
        if args.module and args.training_script.split(".")[0] == "meshtrain":
            # `-m meshtrain ...`: the installed meshtrain, not a meshtrain/ folder in the
            # working directory (a checkout), which `python -m` would put first on sys.path
            os.environ["PYTHONSAFEPATH"] = "1"
        for sig in FORWARDED:  # a stop signal (Trainer's stop_on_signal) goes to the workers
            signal.signal(sig, _forward_to_workers)
        try:
            with rendezvous_store(args), round_in_worker_env(), watching(watch), \
                    repeated_failures_stop_restarts(args.log_dir), \
                    agent_records(args):  # the run's ending, if the workers fail (agent_ending.py)
                torchrun(args)
        except ChildFailedError as err:
            # torchrun's CLI would print this report as an uncaught exception; keep it.
            print(str(err), file=sys.stderr)
            _report_restarts(args, attempts_before, failed=True)
            summary = f"meshtrain run: the job failed: {watch.failure}." \
                if watch is not None and watch.failure else failure_summary(err, args.log_dir)
            print(summary, file=sys.stderr, flush=True)
            return 1
        except (RendezvousError, WaitTimedOut) as error:
            print(rendezvous_error_line(error, watch, args.rdzv_endpoint), file=sys.stderr,
                  flush=True)
            return 1
        except SignalException as exc:
            name = signal.Signals(exc.sigval).name
            print(f"meshtrain run: got {name}; the workers were stopped.", file=sys.stderr)
            return 128 + int(exc.sigval)
    _report_restarts(args, attempts_before, failed=False)
    return 0


# Signals passed on to the workers instead of ending this agent (their default action): Slurm's
# `--signal=USR1@T` and `scancel --signal=USR1` reach the job step, i.e. this process.
FORWARDED = (signal.SIGUSR1, signal.SIGUSR2)


def _forward_to_workers(signum, frame) -> None:
    """Send ``signum`` to this agent's child processes (torchrun's workers)."""
    children: list[int] = []
    with contextlib.suppress(OSError):
        for task in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{task}/children") as f:
                children += [int(pid) for pid in f.read().split()]
    for pid in children:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)


def restart_notice(max_restarts: int) -> str:
    """What `--max-restarts K` means for the job, said once before the workers start."""
    times = "once" if max_restarts == 1 else f"up to {max_restarts} times"
    return (
        f"meshtrain run: --max-restarts {max_restarts}: if a worker fails, all workers are "
        f"stopped and started again ({times}); a Trainer then resumes from the latest complete "
        "checkpoint of its run (the steps since that checkpoint are lost)."
    )


def _attempt_dirs(log_dir: str | None) -> set[str]:
    """torchrun's per-attempt log folders, `LOG_DIR/<run id>_<random>/attempt_<N>`."""
    if not log_dir:
        return set()
    return set(glob.glob(os.path.join(glob.escape(log_dir), "*", "attempt_*")))


def restarts_done(log_dir: str | None, before: set[str] = frozenset()) -> int:
    """How many times torchrun restarted the workers of the job whose logs are new in `log_dir`."""
    numbers = []
    for path in _attempt_dirs(log_dir) - set(before):
        with contextlib.suppress(ValueError):
            numbers.append(int(os.path.basename(path).removeprefix("attempt_")))
    return max(numbers, default=0)


def _report_restarts(args: argparse.Namespace, before: set[str], failed: bool) -> None:
    restarts = restarts_done(args.log_dir, before)
    if not restarts:
        return
    times = "once after a failure" if restarts == 1 else f"{restarts} times after failures"
    outcome = "the last attempt failed too" if failed else "the last attempt succeeded"
    print(
        f"meshtrain run: the workers were restarted {times} (--max-restarts "
        f"{args.max_restarts}); {outcome}. {_attempt_logs(args)}",
        file=sys.stderr,
        flush=True,
    )


def _attempt_logs(args: argparse.Namespace) -> str:
    """Where torchrun kept what each attempt left (its output only with --tee/--redirects)."""
    folder = os.path.join(args.log_dir, "*", "attempt_N", "LOCAL_RANK")
    if str(args.tee) != "0" or str(args.redirects) != "0":
        return f"Each attempt's output and failed workers' error.json are in {folder}."
    return (f"Each attempt's failed workers' error.json are in {folder} (add --tee 3 to keep "
            "their output there too).")


def _local_processes(nproc_per_node: str) -> int:
    """The workers torchrun starts on this node for ``--nproc-per-node`` (a number or
    auto/cpu/gpu/xpu, resolved as torchrun does)."""
    if str(nproc_per_node).isdigit():
        return int(nproc_per_node)
    import torch

    if nproc_per_node == "gpu" or (nproc_per_node == "auto" and torch.cuda.is_available()):
        return max(1, torch.cuda.device_count())
    if nproc_per_node == "xpu":
        return max(1, torch.xpu.device_count())
    return os.cpu_count() or 1


def prepare_args(args: argparse.Namespace) -> None:
    """Check `args` and fill in the one-node rendezvous; raise `ConfigError` on a user mistake."""
    _check_nproc(args.nproc_per_node)
    _check_entrypoint(args)
    try:
        from torch.distributed.run import parse_min_max_nnodes

        min_nodes, max_nodes = parse_min_max_nnodes(args.nnodes)
    except (ValueError, RuntimeError) as exc:
        raise ConfigError(
            f"--nnodes {args.nnodes!r} is not a node count: give N or MIN:MAX, e.g. --nnodes 2"
        ) from exc
    if not 0 < min_nodes <= max_nodes:
        raise ConfigError(f"--nnodes {args.nnodes!r} needs 0 < MIN <= MAX, e.g. --nnodes 1:4")
    if args.standalone and max_nodes > 1:
        raise ConfigError(
            f"--standalone runs on one node but --nnodes is {args.nnodes}: drop one of them"
        )
    if args.standalone or (max_nodes == 1 and not args.rdzv_endpoint):
        _use_local_rendezvous(args)
    elif max_nodes == 1:
        host, port = _split_endpoint(args.rdzv_endpoint)
        if port and _is_local(host):
            check_port_free(host, port)

    if args.log_dir is None:
        # torchrun makes a temporary log folder anyway; making it here lets the failure
        # summary say where a worker's stderr.log / error.json lie.
        args.log_dir = tempfile.mkdtemp(prefix="meshtrain_run_")
        args.meshtrain_temp_log_dir = True  # removed after a success (launch/endings.py)


def _use_local_rendezvous(args: argparse.Namespace) -> None:
    """One node: c10d rendezvous hosted here on 127.0.0.1, like --standalone but on a known port."""
    port = args.master_port
    if port is None:
        port = find_free_port(LOCAL_HOST)
    else:
        check_port_free(LOCAL_HOST, port)
    args.standalone = False
    args.rdzv_backend = "c10d"
    args.rdzv_endpoint = f"{LOCAL_HOST}:{port}"
    args.rdzv_id = str(uuid.uuid4())
    args.master_addr, args.master_port = LOCAL_HOST, port
    args.local_addr = LOCAL_HOST  # the workers' MASTER_ADDR (else the host name's address)
    if "is_host" not in args.rdzv_conf:
        # Host the store or fail: without this, a port taken after the check makes torchrun
        # connect to whatever holds it as a client and wait there.
        args.rdzv_conf = ",".join(filter(None, [args.rdzv_conf, "is_host=1"]))


def _check_nproc(value: str) -> None:
    if value in _NPROC_WORDS:
        return
    try:
        ok = int(value) > 0
    except ValueError:
        ok = False
    if not ok:
        raise ConfigError(
            f"--nproc-per-node {value!r} is not a positive whole number: give the number of "
            "worker processes on this node, e.g. --nproc-per-node 2 "
            f"(or one of: {', '.join(_NPROC_WORDS)})"
        )


def _check_entrypoint(args: argparse.Namespace) -> None:
    """The script file (or --no-python program) must exist; -m modules are left to Python."""
    target = args.training_script
    if args.module:
        return
    if args.no_python:
        if not (os.path.isfile(target) or shutil.which(target)):
            raise ConfigError(
                f"program {target!r} was not found (--no-python runs it directly): "
                "give a path to an executable or a command on PATH"
            )
        return
    if not os.path.isfile(target):
        raise ConfigError(
            f"training script {target!r} does not exist (looked in {os.getcwd()}): "
            "check the path, or pass -m to run a module"
        )


def _split_endpoint(endpoint: str) -> tuple[str, int | None]:
    """'host:port' -> (host, port); a missing port gives None. Brackets of IPv6 are removed."""
    host, sep, port = endpoint.rpartition(":")
    if not sep or "]" in port:
        return endpoint.strip("[]"), None
    try:
        return host.strip("[]"), int(port)
    except ValueError as exc:
        raise ConfigError(
            f"--rdzv-endpoint {endpoint!r} has no valid port: write it as HOST:PORT"
        ) from exc


def _is_local(host: str) -> bool:
    if host in ("localhost", ""):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def failure_summary(err, log_dir: str | None = None) -> str:
    """One paragraph on the worker that failed first (of a torchrun `ChildFailedError`): the
    one the others' errors followed from, by what each recorded in its error file
    (launch/endings.py), not torchrun's "first observed" (its clock counts whole seconds)."""
    from meshtrain.launch.endings import Failure, first_failure, read_record

    failures = {rank: Failure(rank, f.exitcode, read_record(f.error_file),
                              stopped=f.exitcode == -signal.SIGTERM)  # torchrun stops with it
                for rank, f in err.failures.items()}
    first = first_failure(list(failures.values()))
    failure = err.failures[first.rank]
    # Workers that torchrun itself stopped show up as killed by SIGTERM; count only the others.
    others = sum(1 for r, f in failures.items() if r != first.rank and not f.stopped)
    also = f" ({others} more worker(s) failed after it)" if others else ""
    return (f"meshtrain run: the job failed: rank {first.rank} (local rank {failure.local_rank}, "
            f"pid {failure.pid}) {first.how()} first{also}"
            f"{first.what(where=_output_location(failure, log_dir))}.")


def _output_location(failure, log_dir: str | None) -> str:
    """Where a failed worker's error or output is, after "is"."""
    if failure.error_file and os.path.isfile(failure.error_file):
        return f"in the report above and in {failure.error_file}"
    if log_dir:
        pattern = os.path.join(log_dir, "*", "attempt_*", str(failure.local_rank), "stderr.log")
        logs = [p for p in glob.glob(pattern) if os.path.getsize(p) > 0]
        if logs:
            return f"in {max(logs, key=os.path.getmtime)}"
    return ("above, in this terminal's stderr (to keep it in a file too, add --tee 3 "
            "--log-dir DIR)")


@contextlib.contextmanager
def _restored_process_state(signal_names: str) -> Iterator[None]:
    """Undo what torchrun changes in this process: environment variables and signal handlers."""
    env = dict(os.environ)
    handlers = {sig: signal.getsignal(sig) for sig in FORWARDED}
    for name in signal_names.split(","):
        sig = getattr(signal, name.strip(), None)
        if isinstance(sig, signal.Signals):
            handlers[sig] = signal.getsignal(sig)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(env)
        for sig, handler in handlers.items():
            with contextlib.suppress(ValueError, TypeError):  # not the main thread / C handler
                signal.signal(sig, handler)


if __name__ == "__main__":
    try:
        sys.exit(run())
    except ConfigError as exc:
        print(f"meshtrain run: {exc}", file=sys.stderr)
        sys.exit(2)
