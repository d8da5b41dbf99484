"""A job on one machine listens on loopback only (issue 27): the listening sockets of every process
of a `devices=2` job, a `ps=1,dp=2` job and a `meshtrain run` job, read from /proc while they
train."""

import os
import subprocess
import sys
import textwrap
import time

import pytest
from conftest import script_env
from listening import descendants, listening

from meshtrain.launch.network import IFNAME_VARS, choose_interfaces, is_loopback

TIMEOUT = 120

JOB = textwrap.dedent("""
    import os, sys, time
    import torch, torch.nn as nn, torch.nn.functional as F
    from meshtrain import Callback, Trainer

    class Hold(Callback):  # rank 0 stops in step 3 until the test has looked (the others wait)
        def on_train_step_end(self, trainer, metrics):
            if trainer.global_step == 2 and trainer.is_global_zero:
                open(sys.argv[2] + ".partial", "w").close()
                os.replace(sys.argv[2] + ".partial", sys.argv[2])
                deadline = time.time() + 60
                while not os.path.exists(sys.argv[2] + ".done") and time.time() < deadline:
                    time.sleep(0.05)

    layout = sys.argv[1]
    ps = {"ps_mode": "async"} if "ps" in layout else {}
    trainer = Trainer(layout=layout, devices="auto" if "RANK" in os.environ else 3 if ps else 2, max_steps=4, global_batch_size=8,
                      progress_bar=False, loggers=(), callbacks=[Hold()],
                      run_dir=sys.argv[3], **ps)
    trainer.fit(nn.Linear(4, 1), torch.utils.data.TensorDataset(torch.randn(64, 4),
                torch.randn(64, 1)), optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                loss_fn=F.mse_loss)
""")


def _sockets_while_training(tmp_path, layout: str, launcher: list[str]):
    script, ready = tmp_path / "job.py", tmp_path / "ready"
    script.write_text(JOB)
    env = script_env()
    for var in IFNAME_VARS:
        env.pop(var, None)
    job = subprocess.Popen([sys.executable, *launcher, str(script), layout, str(ready),
                            str(tmp_path / "run")],
                           env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + TIMEOUT
        while not ready.exists() and job.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ready.exists(), f"the job did not reach step 2:\n{job.communicate()[0][-3000:]}"
        processes = descendants(job.pid)
        found = listening(processes)
    finally:
        (tmp_path / "ready.done").touch()
        out = job.communicate(timeout=TIMEOUT)[0]
    assert job.returncode == 0, out[-3000:]
    return processes, found, out


@pytest.mark.timeout(TIMEOUT + 30)
@pytest.mark.parametrize("layout, launcher, processes", [
    ("dp=2", [], 2),  # Trainer(devices=2) from `python job.py`
    ("ps=1,dp=2", [], 3),
    ("dp=2", ["-m", "meshtrain", "run", "--nproc-per-node", "2"], 3),  # + torchrun's agent
], ids=["devices=2", "ps=1,dp=2", "meshtrain-run"])
def test_a_single_machine_job_listens_on_loopback_only(tmp_path, layout, launcher, processes):
    pids, found, out = _sockets_while_training(tmp_path, layout, launcher)
    assert len(pids) >= processes
    assert found, "nothing listened: the probe is broken"
    assert len({pid for pid, _, _ in found}) == processes, found  # every process listens
    exposed = [(pid, address, port) for pid, address, port in found if not is_loopback(address)]
    assert not exposed, f"listening beyond loopback: {exposed}"
    assert "network: lo (loopback only" in out


def test_the_interface_a_user_names_is_kept():
    environ = {"GLOO_SOCKET_IFNAME": "eth7", "NCCL_SOCKET_IFNAME": "^docker"}
    note = choose_interfaces("127.0.0.1", environ)
    assert environ == {"GLOO_SOCKET_IFNAME": "eth7", "NCCL_SOCKET_IFNAME": "^docker",
                       "TP_SOCKET_IFNAME": "eth7"}
    assert "eth7 (named by GLOO_SOCKET_IFNAME; kept yours: NCCL_SOCKET_IFNAME=^docker)" in note


def test_a_local_rendezvous_means_the_loopback_interface():
    for host in ("127.0.0.1", "localhost"):
        environ = {}
        choose_interfaces(host, environ)
        assert set(environ) == set(IFNAME_VARS)
        assert all(os.path.exists(f"/sys/class/net/{name}") for name in environ.values())
        assert len(set(environ.values())) == 1


def test_rank0_hosts_an_env_store_on_master_addr_only(monkeypatch):
    """Processes started by the user with MASTER_ADDR/MASTER_PORT (env://): rank 0's store listens
    on MASTER_ADDR's own address, not on every interface as torch's would."""
    from datetime import timedelta

    from meshtrain.launch.ports import find_free_port
    from meshtrain.launch.spawn import DistEnv, job_store

    port = find_free_port()
    for var in ("MESHTRAIN_STORE", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("MASTER_ADDR", "localhost")
    monkeypatch.setenv("MASTER_PORT", str(port))
    store = job_store(DistEnv(0, 0, 1, 1), timedelta(seconds=10))
    store.set("key", "value")
    assert [address for _, address, p in listening([os.getpid()]) if p == port] == ["127.0.0.1"]


def test_the_interface_that_reaches_an_address_is_the_one_that_has_it():
    """Across machines: gloo/NCCL/TensorPipe use the interface that reaches MASTER_ADDR. Checked
    on this machine's own addresses (loopback always; every other IPv4 interface it has)."""
    from meshtrain.launch.network import interface_reaching, ipv4_addresses, loopback_interface

    assert interface_reaching("127.0.0.1") == (loopback_interface(), "127.0.0.1")
    for name, address in ipv4_addresses().items():
        if name != loopback_interface():
            assert interface_reaching(address) == (name, address)
            environ = {}
            assert f"network: {name} ({address}, the interface that reaches" in \
                choose_interfaces(address, environ)
            assert environ["GLOO_SOCKET_IFNAME"] == name



def test_a_master_addr_of_another_machine_listens_everywhere_with_a_warning():
    """Rank 0 reached at an address it does not have (NAT): torch's behaviour, said out loud;
    a port in use is the user's mistake."""
    from meshtrain.errors import ConfigError
    from meshtrain.launch.network import listening_socket

    with pytest.warns(UserWarning, match="not an address of this machine"):
        sock = listening_socket("192.0.2.77")  # TEST-NET-1: nobody's address
    assert sock.getsockname()[0] in ("0.0.0.0", "::")
    taken = listening_socket("127.0.0.1")
    with pytest.raises(ConfigError, match="in use"):
        listening_socket("127.0.0.1", taken.getsockname()[1])
    sock.close()
    taken.close()


def test_an_interface_that_cannot_be_told_leaves_torchs_default(monkeypatch):
    from meshtrain.errors import ConfigError
    from meshtrain.launch import network

    def no_route(host):
        raise ConfigError(f"no route from this machine to MASTER_ADDR={host!r}")

    monkeypatch.setattr(network, "interface_reaching", no_route)
    environ = {}
    note = choose_interfaces("192.0.2.77", environ)
    assert environ == {} and note.startswith("network: torch's default interfaces (no route")
