"""Every wait of a job's start says what it waits for, or what is wrong, within seconds, and ends
non-zero within its timeout (launch/waits.py, launch/rdzv_watch.py, launch/rendezvous.py).

The situations a platform engineer found silent for 60 to 159 s, each with short timeouts set
here (a 15 s rendezvous, a 15 s start-up):

* ``meshtrain run --nnodes 2`` with one agent started;
* agents given ``--nnodes 2`` and ``3``, and agents given different ``--nproc-per-node``;
* a rendezvous port that another program holds;
* a rendezvous endpoint where nothing listens;
* a wrong ``MASTER_PORT`` on one rank (processes started by hand, env://);
* a node that stops under a fixed ``--nnodes 2`` (its processes frozen with SIGSTOP: no
  connection breaks, as when a node drops off the network), the other node's or the one that
  hosts the rendezvous store.

The first six run at once in one test (they wait, they do not compute).
"""

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, script_env

from meshtrain.launch.ports import find_free_port

TIMEOUT_S = 15  # the rendezvous' join_timeout and the ranks' start-up timeout here
SLACK_S = 40  # start-up (importing torch on a busy machine) and the exit after the timeout

# a torch job of two ranks: its process group made as the Trainer makes it, then STEPS
# all-reduces, each followed by a file OUT/step{i}_rank{r}
JOB = """
import os, sys, time
from datetime import timedelta
import torch, torch.distributed as dist
from meshtrain.launch.spawn import DistEnv, init_process_group
init_process_group(DistEnv.from_environ(), "gloo", timedelta(seconds={timeout}))
t = torch.ones(1)
for i in range(int(sys.argv[2])):
    dist.all_reduce(t)
    open(os.path.join(sys.argv[1], f"step{{i}}_rank{{dist.get_rank()}}"), "w").close()
    time.sleep(0.5)
"""


class Started:
    """A process of the test, its stdout and stderr in one file, when it ended."""

    def __init__(self, folder: Path, name: str, command: list[str], env: dict | None = None):
        self.name, self.log = name, folder / f"{name}.log"
        self.started = time.monotonic()
        self.ended: float | None = None
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                         env=env or script_env(), start_new_session=True)

    def poll(self) -> int | None:
        code = self.proc.poll()
        if code is not None and self.ended is None:
            self.ended = time.monotonic()
        return code

    def text(self) -> str:
        return self.log.read_text()

    def took(self) -> float:
        return self.ended - self.started

    def kill(self) -> None:
        for pid in _tree(self.proc.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()


def _tree(pid: int) -> list[int]:
    found = [pid]
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            for child in (task / "children").read_text().split():
                found += _tree(int(child))
    except (FileNotFoundError, ProcessLookupError):
        pass
    return found


def _agent(folder: Path, name: str, port: int, run_id: str, *options: str,
           nnodes: str = "2", nproc: str = "1", conf: str = "", job: Path | None = None,
           job_args: tuple = ()) -> Started:
    command = [sys.executable, "-m", "meshtrain", "run", "--nnodes", nnodes,
               "--nproc-per-node", nproc, "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id,
               "--rdzv-conf", ",".join(filter(None, [f"join_timeout={TIMEOUT_S}", conf])),
               "--log-dir", str(folder / f"logs_{name}"), *options,
               str(job or folder / "job.py"), str(folder), *job_args]
    return Started(folder, name, command)


def _wait_all(started: list[Started], limit: float) -> None:
    deadline = time.monotonic() + limit
    while any(p.poll() is None for p in started):
        if time.monotonic() > deadline:
            for p in started:
                p.kill()
            pytest.fail("still running after "
                        f"{limit:.0f} s: {[p.name for p in started if p.ended is None]}")
        time.sleep(0.1)


def _line(text: str, pattern: str) -> re.Match:
    found = re.search(pattern, text)
    assert found, f"no line like {pattern!r} in:\n{text[-3000:]}"
    return found


@pytest.mark.timeout(150)
def test_agents_and_ranks_that_cannot_meet_say_why_and_end(tmp_path):
    (tmp_path / "job.py").write_text(JOB.format(timeout=TIMEOUT_S))
    port = {name: find_free_port("127.0.0.1") for name in
            ("alone", "nnodes", "nproc", "taken", "nobody", "master")}
    held = socket.socket()  # another program on the "taken" port: accepts, never answers
    held.bind(("127.0.0.1", port["taken"]))
    held.listen()
    env = {**script_env(), "MASTER_ADDR": "127.0.0.1", "WORLD_SIZE": "2"}
    started = [
        _agent(tmp_path, "alone", port["alone"], "j-alone", job_args=("1",)),
        _agent(tmp_path, "nnodes2", port["nnodes"], "j-n", job_args=("1",)),
        _agent(tmp_path, "nnodes3", port["nnodes"], "j-n", nnodes="3", job_args=("1",)),
        _agent(tmp_path, "nproc1", port["nproc"], "j-p", job_args=("1",)),
        _agent(tmp_path, "nproc2", port["nproc"], "j-p", nproc="2", job_args=("1",)),
        _agent(tmp_path, "taken", port["taken"], "j-t", job_args=("1",)),
        _agent(tmp_path, "nobody", port["nobody"], "j-0", conf="is_host=0", job_args=("1",)),
        # ranks started by hand, rank 1 with a wrong MASTER_PORT (where nothing listens)
        Started(tmp_path, "rank0", [sys.executable, str(tmp_path / "job.py"), str(tmp_path), "1"],
                env={**env, "RANK": "0", "MASTER_PORT": str(port["master"])}),
        Started(tmp_path, "rank1", [sys.executable, str(tmp_path / "job.py"), str(tmp_path), "1"],
                env={**env, "RANK": "1", "MASTER_PORT": str(find_free_port("127.0.0.1"))}),
    ]
    try:
        _wait_all(started, TIMEOUT_S + SLACK_S + 30)
    finally:
        held.close()
    by = {p.name: p for p in started}
    for p in started:  # every one ends non-zero, within its timeout and the start-up
        assert p.poll() != 0, f"{p.name} exited 0:\n{p.text()[-3000:]}"
        assert p.took() < TIMEOUT_S + SLACK_S, f"{p.name} took {p.took():.0f} s"

    alone, where = by["alone"].text(), rf"127\.0\.0\.1:{port['alone']} \(rendezvous id j-alone\)"
    said = _line(alone, rf"meshtrain run: waiting for 1 of 2 nodes at {where}; joined: \S+ "
                 rf"\(agent pid {by['alone'].proc.pid}\), (\d+) s of 15 s")
    assert int(said.group(1)) < TIMEOUT_S
    _line(alone, rf"the rendezvous at {where} timed out after 15 s \(join_timeout\) with 1 of 2 "
          "nodes")
    assert by["alone"].poll() == 1

    for a, b, flag, mine, theirs in (("nnodes2", "nnodes3", "--nnodes", "2", "3"),
                                     ("nproc1", "nproc2", "--nproc-per-node", "1", "2")):
        for me, other, mine_, theirs_ in ((a, b, mine, theirs), (b, a, theirs, mine)):
            _line(by[me].text(), rf"disagree on {flag}: this one \(\S+, agent pid "
                  rf"{by[me].proc.pid}\) has {mine_}, the one at \S+ \(agent pid "
                  rf"{by[other].proc.pid}\) has {theirs_}\. Give every node the same {flag}")
            assert by[me].poll() == 2  # a user's mistake

    _line(by["taken"].text(), rf"127\.0\.0\.1:{port['taken']} is held by a program that is not a "
          rf"c10d store \(it accepts connections but did not answer a store's ping in 3 s; it is "
          rf"pid {os.getpid()} \(\S+\)\).*meshtrain slurm --port PORT")
    assert by["taken"].took() < SLACK_S  # at once, not after the timeout

    nobody = by["nobody"].text()
    _line(nobody, rf"waiting for the rendezvous store \(the agent on 127\.0\.0\.1 hosts it\) at "
          rf"127\.0\.0\.1:{port['nobody']} \(connection refused: nothing listens there yet\), "
          r"\d+ s of 15 s")
    _line(nobody, rf"no store answered at 127\.0\.0\.1:{port['nobody']} within 15 s")

    _line(by["rank0"].text(), rf"rank 0: waiting for 1 of 2 ranks \(rank 1\) to join the job's "
          rf"store at 127\.0\.0\.1:{port['master']}, \d+ s of 15 s")
    _line(by["rank0"].text(), r"rank 1\) did not join the job's store .* within 15 s "
          r"\(init_timeout_s\)")
    _line(by["rank1"].text(), r"rank 1: waiting for the store rank 0 hosts "
          r"\(MASTER_ADDR:MASTER_PORT\) at 127\.0\.0\.1:\d+ \(connection refused: nothing "
          r"listens there yet\), \d+ s of 15 s")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("frozen", ["node 1", "the store's host"])
def test_a_node_that_stops_is_found_by_its_heartbeat(tmp_path, frozen):
    """Two agents of a fixed ``--nnodes 2`` job training; one node's agent and worker are
    frozen (SIGSTOP) after a few steps. The other agent says which node stopped answering (a
    heartbeat every 1 s, dead after 5 s here) and ends the job with that line, instead of its
    worker waiting in an all-reduce for the collective timeout (60 s here)."""
    (tmp_path / "job.py").write_text(JOB.format(timeout=60))
    port = find_free_port("127.0.0.1")
    conf = "keep_alive_interval=1,keep_alive_max_attempt=5"
    host = _agent(tmp_path, "host", port, "j-f", conf=conf, job_args=("200",))
    other = _agent(tmp_path, "other", port, "j-f", conf=conf + ",is_host=0", job_args=("200",))
    stopped, survivor = (other, host) if frozen == "node 1" else (host, other)
    try:
        deadline = time.monotonic() + 90
        while not all((tmp_path / f"step2_rank{r}").exists() for r in (0, 1)):
            assert host.poll() is None and other.poll() is None, host.text() + other.text()
            assert time.monotonic() < deadline, host.text() + other.text()
            time.sleep(0.1)
        for pid in _tree(stopped.proc.pid):
            os.kill(pid, signal.SIGSTOP)
        frozen_at = time.monotonic()
        _wait_all([survivor], 45)
        took = survivor.ended - frozen_at
    finally:
        stopped.kill()
    text = survivor.text()
    assert survivor.poll() == 1, text[-3000:]
    assert took < 25, f"{took:.0f} s"  # 5 s without a heartbeat, then 10 s at most to end
    if frozen == "node 1":
        said = rf"node 1 \(\S+, agent pid {other.proc.pid}\) sent no heartbeat for \d+ s: it is " \
               "taken for dead"
    else:
        said = rf"the rendezvous store at 127\.0\.0\.1:{port} did not answer for 5 s: the agent " \
               "that hosts it has ended, or its node is gone or frozen"
    _line(text, said + "; stopping this node's workers")
    _line(text, "meshtrain run: the job failed: " + said)


def test_the_start_line_states_the_rendezvous_timeouts():
    from types import SimpleNamespace

    from meshtrain.launch.rdzv_watch import agent_watch

    args = SimpleNamespace(rdzv_backend="c10d", nnodes="2", rdzv_endpoint="10.0.0.1:29555",
                           rdzv_id="j1d", rdzv_conf="", max_restarts=0)
    line = agent_watch(args, 1, lambda: None).start_line()
    assert line == (
        "meshtrain run: nodes meet at 10.0.0.1:29555 (rendezvous id j1d): waiting up to 600 s "
        "for 2 nodes (--rdzv-conf join_timeout); a node whose agent sends no heartbeat for 15 s "
        "is taken for dead (keep_alive_interval 5 s x keep_alive_max_attempt)")
    args.nnodes = "1"
    assert agent_watch(args, 1, lambda: None) is None  # one node: nothing to wait for
