"""`meshtrain slurm`: write (and optionally submit) an sbatch script that runs `meshtrain run`
(torchrun) per node.

Slurm starts one task per node; each task runs `meshtrain run`, which starts one worker per GPU
(``--gpus-per-node``) or a given number of CPU workers (``--nproc-per-node``, no GPU asked for).
The nodes meet through c10d rendezvous hosted on the first node of the allocation, at its
address as the other nodes reach it (its name resolved on it, loopback left out), on a port
derived from the job id unless ``--port`` names one: two jobs sharing a node get different
ports. The script runs ``python -P -m meshtrain``, so a ``meshtrain/`` folder in the working
directory (a checkout) is not imported instead of the installed package. Under Slurm a worker
takes SIGTERM (``scancel``, the time limit, a preemption; Slurm sends SIGKILL ``KillWait``
seconds later, 30 by default) as the stop signal: it stops after the step with a checkpoint
(:class:`RequeueOnSignal`). tests/launch/test_slurm_cluster.py submits it to a real one-node
Slurm cluster.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Sequence

from meshtrain.errors import ConfigError

from meshtrain.callbacks import Callback

# The rendezvous port a script derives from the job id: PORT_BASE + SLURM_JOB_ID % PORT_SPAN,
# below Linux's ephemeral ports (32768 and up), where the OS hands out ports to connections.
PORT_BASE, PORT_SPAN = 20000, 10000

# Slurm's time formats: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS.
_TIME = re.compile(r"^(\d+-\d+(:\d{2}){0,2}|\d+(:\d{2}){0,2})$")


def render_sbatch(
    *,
    script: str,
    script_args: Sequence[str] = (),
    nodes: int,
    gpus_per_node: int | None = None,
    nproc_per_node: int | None = None,
    module: bool = False,
    cpus_per_task: int | None = None,
    job_name: str = "meshtrain",
    time: str | None = None,
    partition: str | None = None,
    account: str | None = None,
    output: str = "%x-%j.out",
    port: int | None = None,
    workdir: str | None = None,
    python: str = "python",
    requeue_before: int | None = None,
) -> str:
    """Return the text of an sbatch script that runs `script` (a module with `module=True`) on
    `nodes` x `gpus_per_node` workers, one per GPU, or `nodes` x `nproc_per_node` CPU workers.

    Pure: reads no files and runs nothing. `workdir`, when given, becomes `#SBATCH --chdir`, so
    relative paths mean the same wherever `sbatch` is called from. `port`: the rendezvous port
    on the head node; None: ``PORT_BASE + job id % PORT_SPAN``. `requeue_before`: seconds
    before the time limit at which Slurm sends SIGUSR1, on which the Trainer saves a
    resumable checkpoint and requeues the job (``stop_on_signal``).
    """
    workers = _check_options(nodes, gpus_per_node, nproc_per_node, cpus_per_task, port, time)
    if requeue_before is not None and requeue_before < 1:
        raise ConfigError(f"--requeue-before is {requeue_before}: give the seconds before the "
                          "time limit to stop and requeue at, e.g. --requeue-before 120")
    directives = {
        "job-name": job_name,
        "nodes": nodes,
        "ntasks-per-node": 1,
        "gpus-per-node": gpus_per_node,
        "cpus-per-task": cpus_per_task,
        "time": time,
        "partition": partition,
        "account": account,
        "output": output,
        "chdir": workdir,
        "signal": None if requeue_before is None else f"USR1@{requeue_before}",
    }
    lines = ["#!/bin/bash"]
    for key, value in directives.items():
        if value is None:
            continue
        if not str(value) or any(c.isspace() for c in str(value)):
            what = "the current folder" if key == "chdir" else f"--{key}"
            raise ConfigError(
                f"{what} {str(value)!r} is empty or has spaces, which an #SBATCH line cannot "
                "hold: pick a value (or, for the folder, a place to run from) without spaces"
            )
        lines.append(f"#SBATCH --{key}={value}")
    if requeue_before is not None:  # the requeued run appends to the same log
        lines += ["#SBATCH --requeue", "#SBATCH --open-mode=append"]

    # the Trainer's rule (launch/world.py): the task's CPUs shared by its workers; without
    # --cpus-per-task, the CPUs the task got (nproc reads its affinity)
    threads = max(1, cpus_per_task // workers) if cpus_per_task else \
        f"$(( $(nproc) / {workers} > 0 ? $(nproc) / {workers} : 1 ))"
    cpus_flag = f" --cpus-per-task={cpus_per_task}" if cpus_per_task else ""
    # -P: the installed meshtrain, not a meshtrain/ folder in the working directory
    command = [python, "-P", "-m", "meshtrain", "run"]
    port_value = port if port is not None else \
        f"$(( {PORT_BASE} + SLURM_JOB_ID % {PORT_SPAN} ))"
    port_why = "meshtrain slurm --port" if port is not None else \
        "derived from the job id, so that jobs sharing a node\n" \
        "# differ; meshtrain slurm --port sets one"
    user_part = " ".join(shlex.quote(a) for a in [*(["-m"] if module else []), script,
                                                   *script_args])
    per_node = f"{gpus_per_node} workers (one per GPU)" if gpus_per_node else \
        f"{nproc_per_node} CPU workers"
    lines += [
        "",
        "# Written by `meshtrain slurm`: one task per node runs `meshtrain run` (torchrun),",
        f"# which starts {per_node}; all nodes meet through c10d rendezvous on the first node.",
        "set -euo pipefail",
        "",
        "# CPU threads per worker: the task's CPUs shared by its workers, unless already set.",
        f'export OMP_NUM_THREADS="${{OMP_NUM_THREADS:-{threads}}}"',
        "",
        f"# The rendezvous port on the head node ({port_why}).",
        f"port={port_value}",
        # awk (not head) reads all of scontrol's output, so pipefail never sees a SIGPIPE.
        "head_node=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | awk 'NR == 1')",
        "# Its address as the other nodes reach it: its name resolved on it, loopback left out",
        "# (`hostname --ip-address` says 127.0.1.1 on many hosts).",
        'head_addr=$(srun --nodes=1 --ntasks=1 -w "$head_node" getent ahostsv4 "$head_node"'
        " | awk '$1 !~ /^127\\./ && !found {print $1; found = 1}') || head_addr=\"\"",
        'if [ -z "$head_addr" ]; then',
        '  if [ "$SLURM_NNODES" -gt 1 ]; then',
        '    echo "meshtrain: $head_node resolves to no address but loopback ones on itself, '
        "which the other nodes cannot reach: give it its network address in DNS or /etc/hosts"
        '" >&2',
        "    exit 1",
        "  fi",
        "  head_addr=127.0.0.1  # one node: loopback is enough",
        "fi",
        f'echo "meshtrain: {nodes} node(s), rendezvous at $head_addr:$port ($head_node)"',
        "",
        # srun does not pass --cpus-per-task on from sbatch in recent Slurm; name it again.
        # --kill-on-bad-exit: a node's agent that fails (a port in use) ends the others' too.
        f"srun --kill-on-bad-exit=1{cpus_flag} {' '.join(shlex.quote(c) for c in command)} \\",
        '    --nnodes "$SLURM_NNODES" \\',
        f"    --nproc-per-node {workers} \\",
        '    --rdzv-id "$SLURM_JOB_ID" \\',
        "    --rdzv-backend c10d \\",
        '    --rdzv-endpoint "$head_addr:$port" \\',
        f"    {user_part}",
    ]
    return "\n".join(lines) + "\n"


def _check_options(nodes: int, gpus_per_node: int | None, nproc_per_node: int | None,
                   cpus_per_task: int | None, port: int | None, time: str | None) -> int:
    """Check the options; return the workers per node."""
    if nodes < 1:
        raise ConfigError(f"--nodes is {nodes}: ask for at least 1 node, e.g. --nodes 2")
    if (gpus_per_node is None) == (nproc_per_node is None):
        raise ConfigError(
            "give one of --gpus-per-node G (G workers per node, one per GPU) and "
            "--nproc-per-node N (N CPU workers per node, no GPU asked for)"
        )
    if gpus_per_node is not None and gpus_per_node < 1:
        raise ConfigError(
            f"--gpus-per-node is {gpus_per_node}: it is also the number of workers per node, "
            "so give at least 1, e.g. --gpus-per-node 8"
        )
    if nproc_per_node is not None and nproc_per_node < 1:
        raise ConfigError(f"--nproc-per-node is {nproc_per_node}: give at least 1 worker per "
                          "node, e.g. --nproc-per-node 2")
    if cpus_per_task is not None and cpus_per_task < 1:
        raise ConfigError(f"--cpus-per-task is {cpus_per_task}: give at least 1, or leave it out")
    if port is not None and not 0 < port < 65536:
        raise ConfigError(f"--port is {port}: pick a TCP port in 1..65535, e.g. --port 29500, "
                          "or leave it out to derive one from the job id")
    if time is not None and not _TIME.match(time):
        raise ConfigError(
            f"--time {time!r} is not a Slurm time: write HH:MM:SS (or D-HH:MM:SS), e.g. 04:00:00"
        )
    return gpus_per_node or nproc_per_node


def build_parser() -> argparse.ArgumentParser:
    """The `meshtrain slurm` argument parser."""
    parser = argparse.ArgumentParser(
        prog="meshtrain slurm",
        description="Write an sbatch script that runs SCRIPT with `meshtrain run` (torchrun) on "
        "every node (one worker per GPU, or --nproc-per-node CPU workers), print its path, and "
        "with --submit hand it to sbatch.",
    )
    parser.add_argument("--nodes", type=int, required=True, help="number of nodes")
    parser.add_argument("--gpus-per-node", type=int, help="GPUs = workers per node")
    parser.add_argument("--nproc-per-node", type=int,
                        help="CPU workers per node (instead of --gpus-per-node: no GPU asked for)")
    parser.add_argument("-m", "--module", action="store_true",
                        help="SCRIPT is a module, run as python -m SCRIPT (e.g. -m meshtrain "
                        "train config.toml)")
    parser.add_argument("--cpus-per-task", type=int, help="CPUs per node's task (all workers)")
    parser.add_argument("--job-name", default="meshtrain", help="Slurm job name")
    parser.add_argument("--time", help="time limit, HH:MM:SS")
    parser.add_argument("--partition", help="Slurm partition")
    parser.add_argument("--account", help="Slurm account")
    parser.add_argument("--output", default="%x-%j.out", help="log file (default %%x-%%j.out)")
    parser.add_argument("--port", type=int,
                        help=f"rendezvous port on the head node (default: {PORT_BASE} + the "
                        f"job id modulo {PORT_SPAN}, so that jobs sharing a node differ)")
    parser.add_argument("--requeue-before", type=int, metavar="SECONDS",
                        help="SIGUSR1 this long before the time limit: the Trainer saves a "
                        "checkpoint and requeues the job, which continues from it")
    parser.add_argument("--python", default="python", help="Python on the nodes (default python)")
    parser.add_argument("--submit", action="store_true", help="run sbatch on the written file")
    parser.add_argument("--sbatch-out", help="where to write the script (default JOB_NAME.sbatch)")
    parser.add_argument("script", help="training script")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    return parser


def slurm(argv: Sequence[str] | None = None) -> int:
    """Write the sbatch script for `argv`, print its path, submit it with --submit; exit code."""
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    if not args.module and not os.path.isfile(args.script):
        raise ConfigError(
            f"training script {args.script!r} does not exist (looked in {os.getcwd()}): "
            "check the path, or pass -m to run a module (e.g. -m meshtrain train config.toml)"
        )
    text = render_sbatch(
        script=args.script,
        script_args=args.script_args,
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        nproc_per_node=args.nproc_per_node,
        module=args.module,
        cpus_per_task=args.cpus_per_task,
        job_name=args.job_name,
        time=args.time,
        partition=args.partition,
        account=args.account,
        output=args.output,
        port=args.port,
        workdir=os.getcwd(),
        python=args.python,
        requeue_before=args.requeue_before,
    )
    path = args.sbatch_out or f"{args.job_name}.sbatch"
    with open(path, "w") as f:
        f.write(text)
    print(path)
    if not args.submit:
        return 0
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        raise ConfigError(
            f"Slurm's sbatch was not found on PATH, so nothing was submitted; the script was "
            f"written to {path}: run `sbatch {path}` on a Slurm login node"
        )
    return subprocess.run([sbatch, path], check=False).returncode



class RequeueOnSignal(Callback):
    """Under Slurm: when a stop signal ended the fit (``stop_on_signal``; e.g. sent before the
    time limit by ``#SBATCH --signal=USR1@120``, or by ``scancel --signal=USR1``), rank 0
    requeues the job once its resumable checkpoint is saved. Slurm then ends this run of the
    job and starts it again, and the Trainer continues from that checkpoint.

    SIGTERM (``scancel``, the time limit, a preemption: Slurm sends SIGKILL ``KillWait``
    seconds later) is taken as the stop signal too, where there is one: every rank stops after
    the step with that checkpoint, and the job ends without requeueing itself (it was told to
    end); submitting it again continues from there."""

    def __init__(self, job_id: str):
        self.job_id = job_id
        self.terminated = False  # SIGTERM came
        self._stop_signal = None
        self._previous = None

    def on_fit_start(self, trainer) -> None:
        import signal
        import threading

        from meshtrain.fault.guard import stop_signal

        self._stop_signal = stop_signal(trainer.stop_on_signal, trainer.world_size)
        if self._stop_signal is not None and threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum, frame) -> None:
        if not self.terminated:
            self.terminated = True
            # (os.write: a print here could re-enter a print the signal interrupted)
            os.write(2, (f"meshtrain: SIGTERM received (Slurm ends job {self.job_id}: scancel, "
                         "the time limit or a preemption): taken as the stop signal "
                         f"({self._stop_signal.name}, stop_on_signal): stopping after this step "
                         "with a checkpoint\n").encode())
        os.kill(os.getpid(), self._stop_signal)  # the Trainer's own handler takes it from here

    def on_fit_end(self, trainer) -> None:
        if self._previous is not None:
            import signal

            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None
        if trainer.stop_reason != "signal" or trainer.rank != 0:
            return
        if self.terminated:
            trainer.print(f"Slurm job {self.job_id}: stopped on SIGTERM after step "
                          f"{trainer.global_step} with a checkpoint; submit the job again to "
                          "continue from it")
            sys.stdout.flush()
            return
        scontrol = shutil.which("scontrol") or "scontrol"
        # said first: Slurm may end this run as soon as the requeue is accepted
        trainer.print(f"Slurm job {self.job_id}: requeueing it; it continues from the "
                      "checkpoint just saved")
        sys.stdout.flush()
        done = subprocess.run([scontrol, "requeue", self.job_id], capture_output=True,
                              text=True, check=False)
        if done.returncode != 0:
            trainer.print(f"could not requeue Slurm job {self.job_id} "
                          f"({done.stderr.strip() or done.returncode}): submit it again to "
                          "continue from the checkpoint just saved")


def requeue_callbacks() -> list[Callback]:
    """[RequeueOnSignal] inside a Slurm batch job, else []."""
    job_id = os.environ.get("SLURM_JOB_ID")
    return [RequeueOnSignal(job_id)] if job_id else []


if __name__ == "__main__":
    try:
        sys.exit(slurm())
    except ConfigError as exc:
        print(f"meshtrain slurm: {exc}", file=sys.stderr)
        sys.exit(2)
