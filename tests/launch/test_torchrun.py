"""`meshtrain run` (meshtrain.launch.torchrun): real gloo workers started in-process, and checks."""

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from meshtrain.errors import ConfigError
from meshtrain.launch.ports import check_port_free, find_free_port
from meshtrain.launch.torchrun import build_parser, prepare_args, run

ALL_REDUCE = """
import os, sys
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
t = torch.tensor([float(rank)])
dist.all_reduce(t)
with open(os.path.join(sys.argv[1], f"rank{rank}.txt"), "w") as f:
    f.write(f"{int(t.item())} {os.environ['OMP_NUM_THREADS']} {dist.get_world_size()}")
dist.destroy_process_group()
"""

# Rank 0 waits without a collective, so it cannot fail by itself (then it would race rank 1 to be
# reported first); torchrun stops it once rank 1 has failed.
FAILS_ON_RANK_1 = """
import time
import torch.distributed as dist

dist.init_process_group("gloo")
if dist.get_rank() == 1:
    raise RuntimeError("rank one broke on purpose 7f3a")
time.sleep(50)
"""


def _script(tmp_path, text):
    path = tmp_path / "train.py"
    path.write_text(textwrap.dedent(text))
    return str(path)


@pytest.mark.timeout(60)
def test_two_workers_all_reduce_and_leave_the_process_as_it_was(tmp_path, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    sigterm_before = signal.getsignal(signal.SIGTERM)
    script = _script(tmp_path, ALL_REDUCE)

    logs = str(tmp_path / "logs")
    assert run(["--nproc-per-node", "2", "--log-dir", logs, script, str(tmp_path)]) == 0

    # 0 + 1 summed over both ranks; one OMP thread each by default; a world of 2.
    for rank in (0, 1):
        assert (tmp_path / f"rank{rank}.txt").read_text() == "1 1 2"
    # torchrun's changes to this process (env, signal handlers) are undone.
    assert "OMP_NUM_THREADS" not in os.environ
    assert signal.getsignal(signal.SIGTERM) is sigterm_before


@pytest.mark.timeout(60)
def test_failing_rank_gives_exit_code_1_and_shows_its_traceback(tmp_path, capfd):
    script = _script(tmp_path, FAILS_ON_RANK_1)

    assert run(["--nproc_per_node", "2", "--log_dir", str(tmp_path / "logs"), script]) == 1

    err = capfd.readouterr().err
    assert "RuntimeError: rank one broke on purpose 7f3a" in err  # the worker's own traceback
    summary = [line for line in err.splitlines() if line.startswith("meshtrain run:")]
    assert len(summary) == 1
    assert "rank 1 (local rank 1" in summary[0] and "exited with code 1" in summary[0]


def test_named_port_in_use_is_refused_before_anything_starts(tmp_path):
    script = _script(tmp_path, ALL_REDUCE)
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(ConfigError, match=f"port {port} on 127.0.0.1 is in use"):
            run(["--nproc-per-node", "2", "--master-port", str(port), script, str(tmp_path)])
        with pytest.raises(ConfigError, match="--rdzv-endpoint"):
            run(["--rdzv-endpoint", f"localhost:{port}", script, str(tmp_path)])
    assert not list(tmp_path.glob("rank*.txt"))


def test_missing_script_is_named(tmp_path):
    missing = tmp_path / "nope.py"
    with pytest.raises(ConfigError, match="nope.py' does not exist"):
        run(["--nproc-per-node", "2", str(missing)])


@pytest.mark.parametrize("nproc", ["0", "-1", "two"])
def test_nproc_per_node_must_be_positive(tmp_path, nproc):
    script = _script(tmp_path, ALL_REDUCE)
    with pytest.raises(ConfigError, match="--nproc-per-node"):
        run(["--nproc-per-node", nproc, script])


def test_standalone_with_several_nodes_is_refused(tmp_path):
    script = _script(tmp_path, ALL_REDUCE)
    with pytest.raises(ConfigError, match="--standalone"):
        run(["--standalone", "--nnodes", "2", script])


def test_one_node_gets_a_local_c10d_store_and_several_nodes_pass_through(tmp_path):
    script = _script(tmp_path, ALL_REDUCE)
    one = build_parser().parse_args(["--log-dir", str(tmp_path), script])
    prepare_args(one)
    host, port = one.rdzv_endpoint.split(":")
    assert (one.rdzv_backend, host, one.nproc_per_node) == ("c10d", "127.0.0.1", "1")
    assert int(port) == one.master_port > 0

    given = ["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "10.0.0.9:29400"]
    many = build_parser().parse_args([*given, "--log-dir", str(tmp_path), script])
    prepare_args(many)
    assert many.rdzv_endpoint == "10.0.0.9:29400"
    assert (many.rdzv_backend, many.rdzv_id) == ("c10d", "none")


def test_free_port_can_be_bound_and_a_listening_one_cannot():
    port = find_free_port()
    check_port_free("127.0.0.1", port)  # does not raise
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", port))
        holder.listen()
        with pytest.raises(ConfigError, match="in use"):
            check_port_free("127.0.0.1", port)


WAITS_FOR_SIGUSR1 = """
import os, signal, sys, time
out = sys.argv[1]
got = []
signal.signal(signal.SIGUSR1, lambda *_: got.append(1))
open(os.path.join(out, "ready"), "w").close()
deadline = time.monotonic() + 30
while not got and time.monotonic() < deadline:
    time.sleep(0.02)
open(os.path.join(out, "got_sigusr1" if got else "no_signal"), "w").close()
"""


@pytest.mark.timeout(60)
def test_sigusr1_to_the_agent_reaches_the_workers_and_does_not_end_the_agent(tmp_path):
    """What Slurm's --signal does when it signals the job step's task (this agent) only: the
    Trainer's stop_on_signal must see it in the workers."""
    script = _script(tmp_path, WAITS_FOR_SIGUSR1)
    agent = subprocess.Popen([sys.executable, "-m", "meshtrain", "run", "--nproc-per-node", "1",
                              script, str(tmp_path)], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 40
    while not (tmp_path / "ready").exists():
        assert agent.poll() is None and time.monotonic() < deadline, agent.stdout.read()
        time.sleep(0.05)
    agent.send_signal(signal.SIGUSR1)  # the agent alone
    out, _ = agent.communicate(timeout=40)
    assert agent.returncode == 0, out[-3000:]
    assert (tmp_path / "got_sigusr1").exists()
