"""Asynchronous checkpoints on CPU are written by a process of each rank's own
(meshtrain/checkpoint/writer_process.py): the files are DCP's, the values those of save time,
nothing is left in shared memory, and the writer goes when its training process goes."""

import glob
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed.checkpoint.filesystem as dcp_filesystem
import torch.nn as nn
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from meshtrain.checkpoint import writer_process
from meshtrain.checkpoint.manager import CheckpointManager, CheckpointWriteError
from meshtrain.launch.spawn import run_workers
from meshtrain.parallel.shm.p2p import _alive

pytestmark = pytest.mark.filterwarnings(
    "ignore:torch.distributed is disabled:UserWarning")  # DCP's thread, in one process


def _model_and_adamw(width=256):
    torch.manual_seed(0)
    # 128 KiB weights (shared-memory buffers) and small biases (sent by value)
    model = nn.Sequential(nn.Linear(128, width), nn.ReLU(), nn.Linear(width, 128))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, optimizer


def _step(model, optimizer, seed):
    gen = torch.Generator().manual_seed(seed)
    model(torch.randn(4, 128, generator=gen)).square().sum().backward()
    optimizer.step()
    optimizer.zero_grad()


def _snapshot(model, optimizer):
    names = {id(p): k for k, p in model.named_parameters()}
    return ({k: v.detach().clone() for k, v in model.state_dict().items()},
            {names[id(p)]: s["exp_avg"].clone() for p, s in optimizer.state.items()})


def _read(folder, tmp_path):
    out = tmp_path / f"{folder.name}.pt"
    dcp_to_torch_save(folder, out)
    state = torch.load(out, weights_only=True)
    return state["model"], {k: v["exp_avg"] for k, v in state["optim"]["state"].items()}


def _same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _save(mgr, step, model, optimizer):
    assert mgr.save(step, model, optimizer, {"global_step": step}, {"step": step})


def test_the_write_runs_in_a_process_of_its_own_with_the_values_at_save_time(tmp_path,
                                                                             monkeypatch):
    def not_here(*args, **kwargs):
        raise AssertionError("a checkpoint file was written by the training process")

    monkeypatch.setattr(dcp_filesystem, "_write_item", not_here)  # (this process's only)
    model, optimizer = _model_and_adamw()
    _step(model, optimizer, 0)
    mgr = CheckpointManager(tmp_path, async_save=True)
    for step in (1, 2):  # the second save reuses the buffers the writer has mapped
        before = _snapshot(model, optimizer)
        _save(mgr, step, model, optimizer)
        mgr.before_update()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        _step(model, optimizer, step)
        assert mgr.wait() == tmp_path / f"step_{step:08d}"
        saved = _read(tmp_path / f"step_{step:08d}", tmp_path)
        assert _same(saved[0], before[0]) and _same(saved[1], before[1])
    process, buffers = mgr._writer
    assert process.proc.pid != os.getpid() and process.proc.poll() is None
    shared = [path for path, _, _ in buffers.files.values()]
    assert len(shared) == 6  # two weights, their exp_avg and exp_avg_sq: the biases are small
    assert not any(os.path.exists(path) for path in shared)  # unlinked once mapped
    assert glob.glob(f"{writer_process.SHARED_DIR}/meshtrain-ckpt-{buffers.token}-*") == []
    process.close()
    assert process.proc.returncode == 0


def test_a_state_of_another_layout_gets_buffers_of_its_own(tmp_path):
    # two models of other shapes saved by turns through one manager: every buffer is made
    # again each time (the old ones forgotten, here and in the writer), and each save holds
    # its own values
    models = [_model_and_adamw(), _model_and_adamw(width=192)]
    mgr = CheckpointManager(tmp_path, async_save=True)
    for step, (model, optimizer) in enumerate(models * 2, start=1):
        _step(model, optimizer, step)
        before = _snapshot(model, optimizer)
        _save(mgr, step, model, optimizer)
        mgr.wait()
        saved = _read(tmp_path / f"step_{step:08d}", tmp_path)
        assert _same(saved[0], before[0]) and _same(saved[1], before[1])
    buffers = mgr._writer[1]
    assert len(buffers.files) == 6 and buffers.count == 4 * 6  # a new set per save
    mgr._writer[0].close()


def test_a_writer_process_that_died_fails_the_save_with_its_reason(tmp_path):
    model, optimizer = _model_and_adamw()
    _step(model, optimizer, 0)
    mgr = CheckpointManager(tmp_path, async_save=True)
    _save(mgr, 1, model, optimizer)
    mgr.wait()
    mgr._writer[0].proc.kill()
    mgr._writer[0].proc.wait()
    _save(mgr, 2, model, optimizer)
    with pytest.raises(CheckpointWriteError, match="checkpoint writer process .* exited"):
        mgr.wait()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000001"]  # nothing half-made


def test_without_room_in_shared_memory_the_write_stays_in_a_thread(tmp_path, monkeypatch):
    monkeypatch.setattr(writer_process, "SHARED_DIR", str(tmp_path / "no-shm"))
    model, optimizer = _model_and_adamw()
    _step(model, optimizer, 0)
    before = _snapshot(model, optimizer)
    mgr = CheckpointManager(tmp_path / "ckpts", async_save=True)
    early = mgr._process  # started with the manager, in case the state fits
    _save(mgr, 1, model, optimizer)
    assert mgr._writer is None and mgr._process is None
    assert early.proc.wait(timeout=30) == 0  # closed: nothing for it to write
    assert mgr.wait() == tmp_path / "ckpts" / "step_00000001"
    saved = _read(tmp_path / "ckpts" / "step_00000001", tmp_path)
    assert _same(saved[0], before[0]) and _same(saved[1], before[1])


_KEPT = []  # the worker's manager, never collected: its writer is never closed


def test_shared_memory_that_runs_out_is_a_clear_error_and_leaves_no_file(tmp_path,
                                                                         monkeypatch):
    def full(fd, offset, length):
        raise OSError(28, "No space left on device")

    model, optimizer = _model_and_adamw()
    _step(model, optimizer, 0)
    mgr = CheckpointManager(tmp_path / "ckpts", async_save=True)
    monkeypatch.setattr(writer_process, "SHARED_DIR", str(tmp_path))  # (room enough: checked)
    monkeypatch.setattr(writer_process.os, "posix_fallocate", full, raising=False)
    with pytest.raises(RuntimeError, match=r"cannot take 0.1 MiB more in .*--shm-size"):
        _save(mgr, 1, model, optimizer)
    assert list(tmp_path.glob("meshtrain-ckpt-*")) == []
    mgr._writer[0].close()


def _save_and_leave(directory):
    # a daemonic worker of run_workers (multiprocessing would refuse it a child process)
    torch.set_num_threads(1)
    model, optimizer = _model_and_adamw()
    _step(model, optimizer, 0)
    mgr = CheckpointManager(directory, async_save=True)
    _save(mgr, 1, model, optimizer)
    mgr.wait()
    _KEPT.append(mgr)  # the worker then exits (os._exit: no finalizer runs); only the closed
    return mgr._writer[0].proc.pid  # pipe can tell the writer to go


@pytest.mark.timeout(60)
def test_the_writer_of_a_spawned_worker_ends_with_it(tmp_path):
    (pid,) = run_workers(_save_and_leave, 1, (str(tmp_path),), timeout=50)
    assert (tmp_path / "step_00000001").is_dir()
    deadline = time.monotonic() + 20
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(pid), "the checkpoint writer outlived its training process"


_ORPHAN = """
import os, signal, subprocess, sys
from meshtrain.checkpoint.writer_process import WriterProcess
writer = WriterProcess()
writer.wait_ready()
# another process keeps the writer's stdin open: no end of file will tell it to go
keeper = subprocess.Popen(["sleep", "60"], pass_fds=[writer.proc.stdin.fileno()],
                          stdout=subprocess.DEVNULL)
print(writer.proc.pid, keeper.pid, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
@pytest.mark.timeout(60)
def test_the_writer_is_killed_with_its_training_process():
    helper = subprocess.Popen([sys.executable, "-c", _ORPHAN], stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True)
    writer, keeper = map(int, helper.stdout.readline().split())
    assert helper.wait(timeout=30) == -signal.SIGKILL
    try:
        deadline = time.monotonic() + 10
        while _alive(writer) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(writer), "the writer outlived its training process"
    finally:
        os.kill(keeper, signal.SIGKILL)
