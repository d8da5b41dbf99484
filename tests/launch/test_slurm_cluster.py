"""`meshtrain slurm --submit` against a real Slurm cluster: slurmctld and slurmd (Debian's
slurm-wlm, which .ci/run installs) started on this machine as a one-node cluster, with a munge
daemon of their own, all on free ports and in a temporary folder.

The job is `meshtrain train` on a small char_lm config over 2 CPU workers. A first submission
is cancelled with `scancel` after its first checkpoint; the same job submitted again resumes
from the newest checkpoint and finishes.
"""

import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT

from meshtrain.launch.ports import find_free_port

DAEMONS = ("munged", "slurmctld", "slurmd")
# the daemons live in sbin, which a CI's PATH may leave out
SEARCH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])


def _why_no_slurm() -> str | None:
    missing = [d for d in DAEMONS if shutil.which(d, path=SEARCH) is None]
    if missing:
        return (f"no {', '.join(missing)} on this machine: install Slurm and munge "
                "(apt-get install slurm-wlm munge; .ci/run does it)")
    if os.geteuid() != 0:
        return "slurmd starts jobs as their users and must run as root here"
    return None


class SlurmCluster:
    """One node (this machine, all its cores) in one partition, run from ``folder``."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.host = socket.gethostname().split(".")[0]
        self.env = {**os.environ, "SLURM_CONF": str(folder / "slurm.conf"), "PATH": SEARCH}

    def start(self) -> None:
        f = self.folder
        for sub in ("state", "spool", "munge"):
            (f / sub).mkdir(mode=0o700)
        key = f / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self.socket = f / "munge" / "munge.sock"
        self._run(["munged", "--force", f"--socket={self.socket}", f"--key-file={key}",
                   f"--log-file={f / 'munge' / 'munged.log'}",
                   f"--pid-file={f / 'munge' / 'munged.pid'}",
                   f"--seed-file={f / 'munge' / 'munged.seed'}"])
        ctld_port = find_free_port("127.0.0.1")
        slurmd_port = find_free_port("127.0.0.1")
        cpus = len(os.sched_getaffinity(0))
        (f / "slurm.conf").write_text(f"""\
ClusterName=meshtraintest
SlurmctldHost={self.host}
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
AuthType=auth/munge
AuthInfo=socket={self.socket}
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
StateSaveLocation={f / 'state'}
SlurmdSpoolDir={f / 'spool'}
SlurmctldPidFile={f / 'slurmctld.pid'}
SlurmdPidFile={f / 'slurmd.pid'}
SlurmctldLogFile={f / 'slurmctld.log'}
SlurmdLogFile={f / 'slurmd.log'}
SlurmUser=root
SlurmdUser=root
ReturnToService=2
MpiDefault=none
KillWait=30
MinJobAge=600
NodeName={self.host} CPUs={cpus} State=UNKNOWN
PartitionName=test Nodes={self.host} Default=YES MaxTime=INFINITE State=UP
""")
        self._run(["slurmctld"])
        self._run(["slurmd"])
        deadline = time.monotonic() + 30
        while self.node_state() != "idle":
            assert time.monotonic() < deadline, f"the node never became idle:\n{self.logs()}"
            time.sleep(0.2)

    def _run(self, command: list[str]) -> str:
        command = [shutil.which(command[0], path=SEARCH), *command[1:]]
        done = subprocess.run(command, env=self.env, capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, f"{command}: {done.stderr}\n{self.logs()}"
        return done.stdout

    def node_state(self) -> str:
        done = subprocess.run(["sinfo", "-h", "-o", "%T"], env=self.env, capture_output=True,
                              text=True, timeout=30)
        return done.stdout.strip()

    def job_state(self, job: str) -> str:
        """PENDING, RUNNING, COMPLETED, CANCELLED, FAILED, ... (from slurmctld's memory)."""
        text = self._run(["scontrol", "show", "job", job])
        return re.search(r"JobState=(\w+)", text).group(1)

    def wait(self, job: str, timeout: float = 120) -> str:
        deadline = time.monotonic() + timeout
        while (state := self.job_state(job)) in ("PENDING", "CONFIGURING", "RUNNING",
                                                  "COMPLETING", "REQUEUED"):
            assert time.monotonic() < deadline, f"job {job} still {state} after {timeout} s"
            time.sleep(0.2)
        return state

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}"
                         for p in sorted(self.folder.glob("**/*.log")))

    def stop(self) -> None:
        for pid_file in ("slurmd.pid", "slurmctld.pid", "munge/munged.pid"):
            path = self.folder / pid_file
            if path.exists():
                try:
                    os.kill(int(path.read_text()), signal.SIGTERM)
                except (ProcessLookupError, ValueError):
                    pass


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    why = _why_no_slurm()
    if why:
        pytest.skip(why)
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        try:
            cluster.start()
        except AssertionError as error:  # this machine cannot run the daemons: say why
            pytest.skip(f"a one-node Slurm cluster could not start here: {error}")
        yield cluster
    finally:
        cluster.stop()


def _job_port() -> int:
    """A free port below the ephemeral range for a job's rendezvous: the job binds it seconds
    after submission, and a port the OS handed out for bind(0) may by then be the local end of
    another test's connection (a resubmitted job once failed with "port 36691 ... in use")."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return find_free_port("127.0.0.1")
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(max(1025, low - 12000), low)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    return find_free_port("127.0.0.1")


def _submit(slurm: SlurmCluster, tmp_path: Path, config: Path, *options: str,
            workers: int = 2, cpus: int = 2, train_args: tuple = (), port: str = "free",
            cwd: Path = ROOT) -> str:
    """`meshtrain slurm --submit` for `meshtrain train CONFIG` on CPU workers; the job id.
    ``port``: "free" (a free one), "derived" (none given: the script's, from the job id), or
    a number."""
    port = str(_job_port()) if port == "free" else port
    command = [sys.executable, "-P", "-m", "meshtrain", "slurm", *options, "--nodes", "1",
               "--nproc-per-node", str(workers),
               "--cpus-per-task", str(cpus), "--job-name", config.stem, "--output",
               str(tmp_path / "%j.out"), *(["--port", port] if port != "derived" else []),
               "--python", sys.executable,
               "--sbatch-out", str(tmp_path / f"{config.stem}.sbatch"),
               "--submit", "-m", "meshtrain", "train", str(config), *train_args]
    done = subprocess.run(command, cwd=cwd, env=slurm.env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    return re.search(r"Submitted batch job (\d+)", done.stdout).group(1)


def _config(tmp_path: Path, runs: Path, every: str, name: str = "tiny",
            steps: int = 300) -> Path:
    """A small char_lm job (300 steps), its run folders under ``runs``."""
    config = tmp_path / f"{name}.toml"
    config.write_text(f"""\
[job]
recipe = "char_lm"
[data]
max_chars = 60000
seq_len = 32
[model]
num_layers = 1
num_heads = 2
d_model = 32
[sample]
num_chars = 10
[trainer]
max_steps = {steps}
global_batch_size = 8
val_every_n_steps = {steps}
limit_val_batches = 2
[checkpoint]
checkpoint_every_n_steps = {every}
{"keep_last_k = 1" if every != '"none"' else ""}
[logging]
name = "{name}"
root_dir = "{runs}"
log_every_n_steps = 10
progress_bar = false
""")
    return config


@pytest.mark.timeout(240)
def test_a_submitted_job_trains_and_a_cancelled_one_resumes_when_submitted_again(slurm,
                                                                                   tmp_path):
    runs = tmp_path / "runs"
    config = _config(tmp_path, runs, "10")
    first = _submit(slurm, tmp_path, config)
    deadline = time.monotonic() + 120
    while not list(runs.glob("tiny/*/checkpoints/step_*")):
        state = slurm.job_state(first)
        assert state in ("PENDING", "CONFIGURING", "RUNNING"), \
            f"job {first} {state} before its first checkpoint:\n" + \
            (tmp_path / f"{first}.out").read_text()[-3000:]
        assert time.monotonic() < deadline, slurm.logs()
        time.sleep(0.05)
    subprocess.run(["scancel", first], env=slurm.env, check=True, timeout=30)  # SIGTERM
    assert slurm.wait(first) == "CANCELLED"
    out = (tmp_path / f"{first}.out").read_text()
    # SIGTERM is the stop signal: both ranks stop after one step, with a checkpoint
    assert f"meshtrain: SIGTERM received (Slurm ends job {first}" in out, out[-3000:]
    stopped = re.search(rf"Slurm job {first}: stopped on SIGTERM after step (\d+) with a "
                        "checkpoint; submit the job again to continue from it", out)
    assert stopped and int(stopped.group(1)) < 300, out[-3000:]
    (run,) = runs.glob("tiny/*")
    assert json.loads((run / "checkpoints" / "final" / "meshtrain.json").read_text())[
        "step"] == int(stopped.group(1))

    second = _submit(slurm, tmp_path, config)
    assert slurm.wait(second) == "COMPLETED", (tmp_path / f"{second}.out").read_text()[-3000:]
    out = (tmp_path / f"{second}.out").read_text()
    resumed = re.search(r"resumed from \S+/checkpoints/(final) at step (\d+)", out)
    assert resumed and resumed.group(2) == stopped.group(1), out[-3000:]
    assert "meshtrain: 1 node(s), rendezvous at" in out
    assert list(runs.glob("tiny/*")) == [run]  # the same run folder, continued
    assert (run / "checkpoints" / "final").is_dir()
    assert not list((run / "checkpoints").glob(".tmp*"))


@pytest.mark.timeout(240)
def test_a_signalled_job_saves_requeues_itself_and_continues_from_that_step(slurm, tmp_path):
    """`scancel --signal=USR1` (what `--requeue-before` has Slurm send before the time limit;
    here Slurm signals every process of the step, the agent and its worker: that the agent
    alone is enough is tests/launch/test_torchrun.py's): the worker stops after the step with
    a checkpoint and requeues the job, which starts again and continues from that step. No
    periodic checkpoints: nothing but the signal's checkpoint could be resumed from."""
    runs = tmp_path / "runs"
    config = _config(tmp_path, runs, '"none"')
    # one worker (two ranks agreeing on the stop step: tests/fault/test_stop_signal.py)
    job = _submit(slurm, tmp_path, config, "--time", "10", "--requeue-before", "60", workers=1,
                  train_args=("--trainer.devices=1", "--trainer.layout=dp=1"))
    assert "#SBATCH --signal=USR1@60" in (tmp_path / "tiny.sbatch").read_text()
    deadline = time.monotonic() + 120
    while len(list(runs.glob("tiny/*/metrics.csv")) and
              next(runs.glob("tiny/*/metrics.csv")).read_text().splitlines()) < 3:
        assert slurm.job_state(job) in ("PENDING", "CONFIGURING", "RUNNING"), \
            (tmp_path / f"{job}.out").read_text()[-3000:]
        assert time.monotonic() < deadline, slurm.logs()
        time.sleep(0.05)  # until step 20 is logged
    subprocess.run(["scancel", "--signal=USR1", job], env=slurm.env, check=True, timeout=30)
    deadline = time.monotonic() + 60
    while not re.search(r"JobState=PENDING .*Restarts=1",
                        " ".join(slurm._run(["scontrol", "show", "job", job]).split())):
        assert time.monotonic() < deadline, (tmp_path / f"{job}.out").read_text()[-3000:]
        time.sleep(0.1)
    # Slurm holds a requeued job for 2 minutes (EligibleTime = requeue + 121 s): not here
    slurm._run(["scontrol", "update", f"JobId={job}", "StartTime=now"])
    assert slurm.wait(job) == "COMPLETED", (tmp_path / f"{job}.out").read_text()[-3000:]

    out = (tmp_path / f"{job}.out").read_text()  # both runs of the job (--open-mode=append)
    stop = re.search(r"step (\d+) \(epoch \d+\): SIGUSR1 received; stopping after this step",
                     out)
    assert stop and 20 <= int(stop.group(1)) < 300, out[-3000:]
    assert f"Slurm job {job}: requeueing it" in out
    assert re.search(rf"resumed from \S+/checkpoints/final at step {stop.group(1)} ", out), \
        out[-3000:]
    (run,) = runs.glob("tiny/*")
    assert json.loads((run / "checkpoints" / "final" / "meshtrain.json").read_text())[
        "step"] == 300


@pytest.mark.timeout(240)
def test_two_jobs_share_the_node_on_ports_of_their_own_and_a_taken_port_is_named(slurm,
                                                                                 tmp_path):
    """Two jobs submitted without --port, from a folder that holds a meshtrain/ package of its
    own (a stale checkout, which fails when imported): each script takes 20000 + its job id
    % 10000 as its rendezvous port, both train on the one node at the same time and finish,
    with the installed meshtrain (``python -P``; `-m meshtrain` workers get PYTHONSAFEPATH). A
    third job, given a --port another program holds, fails at once with a line naming
    `meshtrain slurm --port`."""
    decoy = tmp_path / "meshtrain"
    decoy.mkdir()
    (decoy / "__init__.py").write_text("raise ImportError('the meshtrain/ folder in the "
                                       "working directory was imported')\n")
    runs = tmp_path / "runs"
    one = dict(workers=1, cpus=1, cwd=tmp_path,
               train_args=("--trainer.devices=1", "--trainer.layout=dp=1"))
    jobs = [_submit(slurm, tmp_path, _config(tmp_path, runs, '"none"', name=name, steps=60),
                    port="derived", **one) for name in ("a", "b")]
    held = socket.socket()
    held.bind(("127.0.0.1", _job_port()))
    held.listen()
    held_port = held.getsockname()[1]
    try:
        taken = _submit(slurm, tmp_path, _config(tmp_path, runs, '"none"', name="c", steps=60),
                        port=str(held_port), **one)
        both_running, deadline = False, time.monotonic() + 180
        while (states := [slurm.job_state(j) for j in jobs]) != ["COMPLETED"] * 2:
            both_running |= states == ["RUNNING"] * 2
            assert not set(states) & {"FAILED", "CANCELLED", "TIMEOUT"}, \
                [(tmp_path / f"{j}.out").read_text()[-2000:] for j in jobs]
            assert time.monotonic() < deadline, states
            time.sleep(0.1)
        assert slurm.wait(taken) == "FAILED"
    finally:
        held.close()
    assert both_running
    ports = []
    for job in jobs:
        out = (tmp_path / f"{job}.out").read_text()
        said = re.search(r"meshtrain: 1 node\(s\), rendezvous at [\d.]+:(\d+) ", out)
        assert said and int(said.group(1)) == 20000 + int(job) % 10000, out[-2000:]
        ports.append(said.group(1))
    assert ports[0] != ports[1]
    for name in ("a", "b"):
        (run,) = runs.glob(f"{name}/*")
        assert json.loads((run / "checkpoints" / "final" / "meshtrain.json").read_text())[
            "step"] == 60
    out = (tmp_path / f"{taken}.out").read_text()
    assert re.search(rf"port {held_port} on 127\.0\.0\.1 is in use .*meshtrain "
                     r"slurm --port PORT", out), out[-2000:]
