"""Several `meshtrain run` agents on this machine, one "node" each, forming one job through c10d
rendezvous on 127.0.0.1: a multi-node job for real (separate agents and process trees), equal to
one process; and elastic scale-down (`--nnodes 1:2`): one node's agent and workers SIGKILLed
mid-run, the survivor restarts at the smaller world size and resumes at the exact next sample;
when the node comes back, the job grows again.

The job is tests/launch/multinode_job.py (the resume matrix's model and data); the reference is
the resume matrix's one-process fit, in this process.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from checkpoint.resume_matrix_lib import PARAM_TOL, fit
from conftest import ROOT

from meshtrain.launch.ports import find_free_port

JOB = Path(__file__).with_name("multinode_job.py")
STEPS = 8  # the elastic job's; the two-node jobs train 4
# Fast rendezvous for a test: a round with fewer than the most nodes closes 5 s after the
# minimum joined; a node missing 5 heartbeats 1 s apart is dead.
FAST_RDZV = "last_call_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=5"


@pytest.fixture(scope="module")
def reference(tmp_path_factory, one_thread_per_module):
    """One process, STEPS steps: losses, global batches, and the full state at step 4 and end."""
    return fit("1 process", tmp_path_factory.mktemp("reference"), STEPS, capture_steps=(4,))


class Agents:
    """`meshtrain run` agents started as separate process trees; all killed at the end."""

    def __init__(self, out: Path):
        self.out, self.port, self.procs = out, find_free_port("127.0.0.1"), {}
        self.killed: set[str] = set()

    def start(self, name: str, nnodes: str, job_args: list[str], *, max_restarts: int = 0,
              host: bool = True, rdzv: str = FAST_RDZV) -> subprocess.Popen:
        conf = rdzv + ("" if host else ",is_host=0")
        command = [sys.executable, "-m", "meshtrain.cli", "run", "--nnodes", nnodes,
                   "--nproc-per-node", "1", "--max-restarts", str(max_restarts),
                   "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{self.port}",
                   "--rdzv-id", f"test-{self.port}", "--rdzv-conf", conf,
                   "--log-dir", str(self.out / f"logs_{name.replace(' ', '_')}"),
                   str(JOB), str(self.out), *job_args]
        log = open(self.out / f"agent_{name.replace(' ', '_')}.log", "w")
        self.procs[name] = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True,
                                            env={**os.environ, "OMP_NUM_THREADS": "1"})
        return self.procs[name]

    def log(self, name: str) -> str:
        return (self.out / f"agent_{name.replace(' ', '_')}.log").read_text()

    def wait(self, name: str, timeout: float = 90) -> int:
        return self.procs[name].wait(timeout=timeout)

    def kill_node(self, name: str) -> None:
        """SIGKILL the agent and every process under it, as a node that dies would lose them
        (torchrun starts its workers in sessions of their own: killing the agent's process
        group would leave them running)."""
        victims = _tree(self.procs[name].pid)
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
        self.procs[name].wait()
        self.killed.add(name)

    def kill_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                for pid in _tree(proc.pid):
                    with _gone():
                        os.kill(pid, signal.SIGKILL)
                proc.wait()


def _tree(pid: int) -> list[int]:
    """``pid`` and its descendants (Linux /proc)."""
    found = [pid]
    with _gone():
        for task in Path(f"/proc/{pid}/task").iterdir():
            for child in (task / "children").read_text().split():
                found += _tree(int(child))
    return found


class _gone:
    """Ignore a process that ended meanwhile."""

    def __enter__(self):
        return self

    def __exit__(self, kind, *_):
        return kind is not None and issubclass(kind, (ProcessLookupError, FileNotFoundError))


@pytest.fixture
def agents(tmp_path):
    started = Agents(tmp_path)
    yield started
    started.kill_all()


def records(out: Path) -> dict[tuple[int, int], dict]:
    """{(rendezvous round, rank): what that worker wrote}."""
    found = {}
    for path in out.glob("round*_rank*.json"):
        round_, rank = path.stem.removeprefix("round").split("_rank")
        found[int(round_), int(rank)] = json.loads(path.read_text())
    return found


def global_batches(workers: list[dict]) -> dict[int, list[int]]:
    """{step: sorted dataset indices of the global batch}: the union over the data-parallel
    ranks (pipeline peers of one data rank must have fetched the same samples)."""
    by_dp_rank: dict[int, dict] = {}
    for worker in workers:
        seen = by_dp_rank.setdefault(worker["dp_rank"], worker["fetched"])
        assert seen == worker["fetched"], "pipeline peers fetched different samples"
    steps = {int(s) for fetched in by_dp_rank.values() for s in fetched}
    return {step: sorted(i for fetched in by_dp_rank.values() for i in fetched.get(str(step), []))
            for step in steps}


def assert_state_close(state: dict, expected: dict) -> None:
    assert state.keys() == expected.keys()
    for key, value in expected.items():
        diff = (state[key].double() - value.double()).abs().max().item()
        assert diff <= PARAM_TOL, f"{key}: differs by {diff:.2e} from one process"


def wait_for(paths: list[Path], agents: Agents, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        for name, proc in agents.procs.items():
            assert name in agents.killed or proc.poll() is None, \
                f"agent {name} ended early:\n{agents.log(name)[-3000:]}"
        assert time.monotonic() < deadline, f"no {paths} within {timeout} s"
        time.sleep(0.05)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("layout", ["dp=2", "pp=2"])
def test_two_nodes_train_like_one_process(agents, reference, layout):
    """Two agents of 1 rank each: data parallel across the nodes, or one pipeline stage per
    node. The second agent is started first and joins the store the first one hosts."""
    job = ["--layout", layout, "--steps", "4"]
    agents.start("b", "2", job, host=False)
    agents.start("a", "2", job)
    for name in ("a", "b"):
        assert agents.wait(name) == 0, agents.log(name)[-3000:]
    # the timeouts said at start (by rank 0, on either node)
    assert "timeouts: a rank waits 600 s for the others to start and for a collective of the " \
        "first step (init_timeout_s), then 300 s (collective_timeout_s)" in \
        agents.log("a") + agents.log("b")

    workers = records(agents.out)
    assert sorted(workers) == [(0, 0), (0, 1)]  # one round, two ranks
    for (_, rank), worker in workers.items():
        env = worker["env"]
        assert (env["WORLD_SIZE"], env["GROUP_WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == \
            ("2", "2", "1")
        assert worker["done"] and worker["layout"] == layout
        assert (worker["nodes"], worker["planner_nodes"], worker["planner_devices_per_node"]) \
            == (2, 2, 1)
    assert {w["env"]["GROUP_RANK"] for w in workers.values()} == {"0", "1"}  # two nodes
    environment = json.loads((agents.out / "run" / "environment.json").read_text())
    assert (environment["nodes"], environment["processes_per_node"]) == (2, 1)

    losses = workers[0, 0]["losses"]
    for step in range(1, 5):
        assert abs(losses[str(step)] - reference["losses"][step]) <= 1e-5, step
    batches = global_batches(list(workers.values()))
    assert batches == {step: reference["batches"][step] for step in range(1, 5)}
    assert_state_close(torch.load(agents.out / "final_state.pt"), reference["states"][4])


@pytest.mark.timeout(200)
def test_a_lost_node_is_left_behind_and_a_returning_one_taken_back(agents, reference):
    """dp=auto over nodes a and b (``--nnodes 1:2``), a checkpoint every 2 steps. During step 4
    node b dies (its agent and worker SIGKILLed): node a's agent restarts its worker at world
    size 1, which resumes from step 2's checkpoint. During its step 6 node b comes back: both
    agents restart their workers at world size 2, which resume from step 4's checkpoint and
    train to step 8. Every global batch's samples, and the final model, are those of one
    process that never stopped."""
    out = agents.out
    job = ["--layout", "dp=auto", "--steps", str(STEPS), "--checkpoint-every", "2",
           "--pause", "3:2", "--pause", "5:1"]
    agents.start("b", "1:2", job, max_restarts=1, host=False)
    agents.start("a", "1:2", job, max_restarts=1)
    wait_for([out / "paused_s3_rank0", out / "paused_s3_rank1"], agents)
    agents.kill_node("b")
    (out / "go_s3").touch()
    wait_for([out / "paused_s5_rank0"], agents)
    agents.start("b again", "1:2", job, max_restarts=1, host=False)
    for name in ("a", "b again"):
        assert agents.wait(name) == 0, agents.log(name)[-3000:]
    assert "restarted once after a failure" in agents.log("a")

    workers = records(out)
    rounds = sorted({r for r, _ in workers})
    assert len(rounds) == 3, sorted(workers)
    two, one, two_again = ([w for (r, _), w in sorted(workers.items()) if r == n] for n in rounds)
    assert [(len(ws), ws[0]["world_size"], ws[0]["start_step"]) for ws in (two, one, two_again)] \
        == [(2, 2, 0), (1, 1, 2), (2, 2, 4)]
    assert [w["done"] for w in two + one + two_again] == [False] * 3 + [True] * 2
    # node a restarted after a failure (restart count 1), node b came back new (count 0):
    # the workers of one round find each other by the round, not by the restart count
    counts = {w["agent_pid"]: w["env"]["TORCHELASTIC_RESTART_COUNT"] for w in two_again}
    assert counts == {agents.procs["a"].pid: "1", agents.procs["b again"].pid: "0"}

    batches = {**{s: b for s, b in global_batches(two).items() if s <= 2},
               **{s: b for s, b in global_batches(one).items() if s <= 4},
               **global_batches(two_again)}
    assert batches == reference["batches"]  # steps 1-8, each global batch once
    assert_state_close(torch.load(out / "final_state.pt"), reference["states"]["end"])
    checkpoints = [p.name for p in (out / "run" / "checkpoints").iterdir()]
    assert checkpoints and not [name for name in checkpoints if not name.startswith("step_")]


@pytest.mark.timeout(150)
def test_a_fixed_layout_that_does_not_fit_the_nodes_there_are_says_so(agents):
    """One node of an elastic 1:2 job (the other lost, or not come): dp=2 cannot run on the
    world size 1 the job has; the layout is named, with the world size and the fix. (The
    layout is resolved again in the same way after each membership change: the test above.)"""
    # (no other node will come: the round closes 1 s after this one joins, not 5)
    agents.start("a", "1:2", ["--layout", "dp=2", "--steps", "4"],
                 rdzv=FAST_RDZV.replace("last_call_timeout=5", "last_call_timeout=1"))
    assert agents.wait("a") == 1
    (worker,) = records(agents.out).values()
    error = worker["error"]
    assert "'dp=2' needs 2 processes" in error and "the world size is 1" in error
    assert "This elastic job has 1 node(s) now" in error and "dp=auto" in error
    assert "meshtrain run: the job failed: rank 0" in agents.log("a")
