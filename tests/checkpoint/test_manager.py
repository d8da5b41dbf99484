"""CheckpointManager: naming, listing, pruning and validation in one process; sync, async,
pruning, interrupted saves and the non-finite guard on 2 ranks (gloo)."""

import json
import math
import os
import time
import warnings
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from meshtrain.checkpoint import manager as manager_module
from meshtrain.checkpoint.manager import (
    CheckpointManager,
    all_finite,
    checkpoint_name,
    latest_complete,
    list_complete,
    young_daly_interval_s,
)
from meshtrain.errors import ConfigError
from meshtrain.launch.spawn import DistEnv, init_process_group, run_workers


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------
def _fake_checkpoint(folder: Path, step=None, *, metadata=True, mtime=None) -> Path:
    """A folder that looks like a checkpoint to the listing functions (no real DCP data)."""
    folder.mkdir(parents=True)
    (folder / "trainer_state.pt").write_bytes(b"x")
    (folder / "meshtrain.json").write_text(json.dumps({} if step is None else {"step": step}))
    if metadata:
        (folder / ".metadata").write_bytes(b"x")
    if mtime is not None:
        os.utime(folder, (mtime, mtime))
    return folder


def _model_and_adamw(seed=0, shard=False):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    if shard:
        _shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, optimizer


def _step(model, optimizer, seed):
    gen = torch.Generator().manual_seed(seed)
    model(torch.randn(4, 8, generator=gen)).square().sum().backward()
    optimizer.step()
    optimizer.zero_grad()


def _full(t):
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def _snapshot(model, optimizer):
    """Full (gathered) parameters and AdamW exp_avg by parameter name: collective under FSDP2."""
    params = {k: _full(v) for k, v in model.named_parameters()}
    by_id = {id(p): k for k, p in model.named_parameters()}
    exp_avg = {by_id[id(p)]: _full(s["exp_avg"]) for p, s in optimizer.state.items()}
    return params, exp_avg


def _read(ckpt: Path, tmp: Path):
    """What a checkpoint folder holds, as plain tensors: (params, exp_avg by name)."""
    out = tmp / f"{ckpt.name}.pt"
    dcp_to_torch_save(ckpt, out)
    sd = torch.load(out, weights_only=True)
    return sd["model"], {k: v["exp_avg"] for k, v in sd["optim"]["state"].items()}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _init():
    torch.set_num_threads(1)
    init_process_group(DistEnv.from_environ(), "gloo", timedelta(seconds=60))
    return dist.get_rank()


def _shard(model):
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    return fully_shard(model)


def _trainer_state(step):
    return {"global_step": step}


def _summary(step):
    return {"step": step}


# ---------------------------------------------------------------------------------------------
# one process
# ---------------------------------------------------------------------------------------------
def test_checkpoint_name_has_eight_digits():
    assert checkpoint_name(12) == "step_00000012"
    assert checkpoint_name(0) == "step_00000000"
    assert checkpoint_name(12345678) == "step_12345678"


def test_list_complete_orders_by_step_and_skips_tmp_and_incomplete(tmp_path):
    _fake_checkpoint(tmp_path / checkpoint_name(20), 20)
    _fake_checkpoint(tmp_path / checkpoint_name(3), 3)
    _fake_checkpoint(tmp_path / checkpoint_name(100), None)  # no "step" key: from the name
    _fake_checkpoint(tmp_path / ".tmp-step_00000500", 500)  # complete-looking but unrenamed
    _fake_checkpoint(tmp_path / checkpoint_name(400), 400, metadata=False)  # DCP not finished
    (tmp_path / "notes").mkdir()
    (tmp_path / "stray.txt").write_text("x")
    names = [p.name for p in list_complete(tmp_path)]
    assert names == ["step_00000003", "step_00000020", "step_00000100"]
    assert latest_complete(tmp_path) == tmp_path / "step_00000100"
    assert latest_complete(tmp_path / "missing") is None and list_complete(tmp_path / "x") == []


def test_final_is_listed_by_its_step_and_ties_go_to_the_newest(tmp_path):
    _fake_checkpoint(tmp_path / checkpoint_name(10), 10, mtime=1_000)
    _fake_checkpoint(tmp_path / "final", 10, mtime=2_000)
    _fake_checkpoint(tmp_path / checkpoint_name(5), 5, mtime=3_000)
    assert [p.name for p in list_complete(tmp_path)] == ["step_00000005", "step_00000010", "final"]
    assert latest_complete(tmp_path).name == "final"
    os.utime(tmp_path / checkpoint_name(10), (3_000, 3_000))  # now the step folder is newer
    assert latest_complete(tmp_path).name == "step_00000010"
    _fake_checkpoint(tmp_path / checkpoint_name(11), 11, mtime=0)  # a later step wins on step
    assert latest_complete(tmp_path).name == "step_00000011"


def test_young_daly_interval():
    assert young_daly_interval_s(10.0, 86_400.0) == pytest.approx(math.sqrt(2 * 10 * 86_400))
    assert young_daly_interval_s(0.0, 100.0) == 0.0
    for cost, mtbf in [(-1.0, 100.0), (1.0, 0.0), (1.0, -5.0), (float("nan"), 1.0)]:
        with pytest.raises(ConfigError):
            young_daly_interval_s(cost, mtbf)


@pytest.mark.parametrize("kwargs", [
    dict(every_n_steps=0), dict(every_n_steps=-3), dict(every_n_steps=2.5),
    dict(every_n_steps=True), dict(every_n_minutes=0), dict(every_n_minutes=-1.0),
    dict(every_n_minutes=float("nan")), dict(every_n_minutes="5"), dict(keep_last_k=0),
    dict(keep_last_k=1.0), dict(async_save="yes"),
])
def test_bad_settings_raise_config_error(tmp_path, kwargs):
    with pytest.raises(ConfigError):
        CheckpointManager(tmp_path, **kwargs)


def test_all_finite_looks_at_parameters_and_optimizer_state():
    model, optimizer = _model_and_adamw()
    assert all_finite(model, None) and all_finite(model, optimizer)  # no state yet
    _step(model, optimizer, 0)
    assert all_finite(model, optimizer)
    with torch.no_grad():
        optimizer.state[model[2].weight]["exp_avg"][1, 2] = -float("inf")
    assert all_finite(model, None) and not all_finite(model, optimizer)
    model, optimizer = _model_and_adamw()
    with torch.no_grad():
        model[0].bias[3] = float("nan")
    assert not all_finite(model, optimizer)


def test_due_by_steps_and_time(tmp_path, monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(manager_module, "_now", lambda: clock[0])
    never = CheckpointManager(tmp_path)
    assert not never.due_by_steps(10) and not never.due_by_time()
    mgr = CheckpointManager(tmp_path, every_n_steps=5, every_n_minutes=0.5)
    assert [s for s in range(1, 16) if mgr.due_by_steps(s)] == [5, 10, 15]
    clock[0] += 29.0
    assert not mgr.due_by_time()
    clock[0] += 1.0
    assert mgr.due_by_time()
    model, optimizer = _model_and_adamw()
    assert mgr.save(7, model, optimizer, _trainer_state(7), _summary(7))
    assert not mgr.due_by_time()  # counted from the start of the last save
    clock[0] += 30.0
    assert mgr.due_by_time()


def test_single_process_pruning_keeps_final_tmp_and_the_newest(tmp_path):
    model, optimizer = _model_and_adamw()
    _step(model, optimizer, 0)
    CheckpointManager(tmp_path).save_to(tmp_path / "final", 0, model, optimizer, _trainer_state(0),
                                       _summary(0))
    _fake_checkpoint(tmp_path / ".tmp-step_00000099", 99)
    mgr = CheckpointManager(tmp_path, keep_last_k=2)
    for step in range(1, 5):
        assert mgr.save(step, model, optimizer, _trainer_state(step), _summary(step))
        assert mgr.last_blocking_s > 0 and mgr.last_save_s > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".tmp-step_00000099", "final", "step_00000003", "step_00000004"]
    # a checkpoint of a lower step committed into a folder holding a newer one (a run resumed
    # from an earlier checkpoint): keep_last_k=1 deletes neither the newest nor the new one
    mgr = CheckpointManager(tmp_path, keep_last_k=1)
    assert mgr.save(2, model, optimizer, _trainer_state(2), _summary(2))
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_00000002", "step_00000004"]
    mgr.save(5, model, optimizer, _trainer_state(5), _summary(5))
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_00000005"]
    assert (tmp_path / "final").is_dir()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # DCP's thread
def test_single_process_async_save_writes_values_at_save_time(tmp_path):
    model, optimizer = _model_and_adamw()
    _step(model, optimizer, 0)
    before = _snapshot(model, optimizer)
    mgr = CheckpointManager(tmp_path, async_save=True)
    assert mgr.save(1, model, optimizer, _trainer_state(1), _summary(1))
    assert mgr.in_flight and latest_complete(tmp_path) is None
    mgr.before_update()  # the copy is made: the state may change now
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    _step(model, optimizer, 1)
    assert mgr.wait() == tmp_path / "step_00000001" and not mgr.in_flight
    saved = _read(tmp_path / "step_00000001", tmp_path)
    assert _same(saved[0], before[0]) and _same(saved[1], before[1])
    assert not _same(saved[0], _snapshot(model, optimizer)[0])


# ---------------------------------------------------------------------------------------------
# two processes
# ---------------------------------------------------------------------------------------------
def _sync_worker(directory):
    rank = _init()
    model, optimizer = _model_and_adamw()
    for p in model.parameters():
        dist.broadcast(p.data, 0)  # replicated, like DDP
    _step(model, optimizer, 0)
    mgr = CheckpointManager(directory, every_n_steps=1)
    assert mgr.save(3, model, optimizer, _trainer_state(3), _summary(3))
    final = Path(directory) / "step_00000003"
    # committed on every rank when save returns: renamed, nothing left under .tmp-*
    seen = (final.is_dir(), latest_complete(directory) == final,
            sorted(p.name for p in Path(directory).iterdir()))
    snapshot = _snapshot(model, optimizer)
    return dict(rank=rank, seen=seen, snapshot=snapshot, in_flight=mgr.in_flight,
                blocking=mgr.last_blocking_s, total=mgr.last_save_s)


@pytest.mark.timeout(120)
def test_two_rank_sync_save_commits_before_returning(tmp_path):
    out = run_workers(_sync_worker, 2, (str(tmp_path / "ckpts"),), timeout=100)
    for r in out:
        assert r["seen"] == (True, True, ["step_00000003"])
        assert not r["in_flight"] and 0 < r["blocking"] and r["total"] == pytest.approx(
            r["blocking"], abs=1e-6)
    ckpt = tmp_path / "ckpts" / "step_00000003"
    assert sorted(p.name for p in ckpt.glob("rng_rank*.pt")) == ["rng_rank0.pt", "rng_rank1.pt"]
    assert json.loads((ckpt / "meshtrain.json").read_text())["step"] == 3
    assert torch.load(ckpt / "trainer_state.pt")["global_step"] == 3
    params, exp_avg = _read(ckpt, tmp_path)
    assert _same(params, out[0]["snapshot"][0]) and _same(exp_avg, out[0]["snapshot"][1])


def _async_worker(directory):
    rank = _init()
    model, optimizer = _model_and_adamw(shard=True)
    _step(model, optimizer, 0)
    at_save = _snapshot(model, optimizer)
    group = dist.new_group(backend="gloo")
    mgr = CheckpointManager(directory, async_save=True, process_group=group)
    assert mgr.save(1, model, optimizer, _trainer_state(1), _summary(1))
    before_commit = (mgr.in_flight, latest_complete(directory))
    mgr.before_update()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # mutate once the copy is made
    # train on the default group while the write goes on, committing once all ranks are done
    steps = 0
    while True:
        done = torch.tensor([int(mgr.poll())])
        dist.all_reduce(done, op=dist.ReduceOp.MIN)
        if done.item():
            break
        _step(model, optimizer, 1 + steps)
        steps += 1
    committed = mgr.commit()
    dist.barrier()
    return dict(rank=rank, at_save=at_save, after=_snapshot(model, optimizer),
                before_commit=before_commit, committed=committed, in_flight=mgr.in_flight,
                latest=latest_complete(directory), blocking=mgr.last_blocking_s,
                total=mgr.last_save_s, steps=steps)


@pytest.mark.timeout(120)
def test_two_rank_async_save_writes_the_values_at_save_time(tmp_path):
    directory = tmp_path / "ckpts"
    out = run_workers(_async_worker, 2, (str(directory),), timeout=100)
    final = directory / "step_00000001"
    for r in out:
        assert r["before_commit"] == (True, None)  # not renamed before commit
        assert not r["in_flight"] and r["latest"] == final
        assert r["total"] >= r["blocking"] > 0
    assert out[0]["committed"] == final
    assert sorted(p.name for p in directory.iterdir()) == ["step_00000001"]
    params, exp_avg = _read(final, tmp_path)
    at_save_params, at_save_exp_avg = out[0]["at_save"]
    assert _same(params, at_save_params) and _same(exp_avg, at_save_exp_avg)
    assert not _same(params, out[0]["after"][0])  # the model did change after save() returned


def _prune_worker(directory):
    rank = _init()
    model, optimizer = _model_and_adamw(shard=True)
    _step(model, optimizer, 0)
    CheckpointManager(directory).save_to(Path(directory) / "final", 0, model, optimizer,
                                         _trainer_state(0), _summary(0))
    if rank == 0:
        _fake_checkpoint(Path(directory) / ".tmp-step_00000099", 99)
    dist.barrier()
    mgr = CheckpointManager(directory, keep_last_k=2, async_save=True,
                            process_group=dist.new_group(backend="gloo"))
    names = []
    for step in range(1, 6):
        _step(model, optimizer, step)
        assert mgr.save(step, model, optimizer, _trainer_state(step), _summary(step))
        names.append(sorted(p.name for p in Path(directory).iterdir()))
    last = mgr.wait()
    names.append(sorted(p.name for p in Path(directory).iterdir()))
    return dict(rank=rank, names=names, last=last, latest=latest_complete(directory))


@pytest.mark.timeout(120)
def test_two_rank_keep_last_k_prunes_only_older_step_checkpoints(tmp_path):
    directory = tmp_path / "ckpts"
    out = run_workers(_prune_worker, 2, (str(directory),), timeout=100)
    r = out[0]
    # before save 3 returns, saves 1 and 2 are committed and save 3 is in flight
    assert r["names"][2] == [".tmp-step_00000003", ".tmp-step_00000099", "final",
                             "step_00000001", "step_00000002"]
    # save 4 committed 3 and pruned 1
    assert r["names"][3] == [".tmp-step_00000004", ".tmp-step_00000099", "final",
                             "step_00000002", "step_00000003"]
    assert r["names"][-1] == [".tmp-step_00000099", "final", "step_00000004", "step_00000005"]
    assert r["last"] == r["latest"] == directory / "step_00000005"
    assert out[1]["latest"] == directory / "step_00000005"


def _interrupted_worker(directory):
    rank = _init()
    model, optimizer = _model_and_adamw(shard=True)
    _step(model, optimizer, 0)
    group = dist.new_group(backend="gloo")
    mgr = CheckpointManager(directory, async_save=True, process_group=group)
    mgr.save(4, model, optimizer, _trainer_state(4), _summary(4))
    mgr.wait()
    _step(model, optimizer, 1)
    mgr.save(8, model, optimizer, _trainer_state(8), _summary(8))
    while not mgr.poll():  # written everywhere, then "killed" before the commit
        time.sleep(0.01)
    tmp = Path(directory) / ".tmp-step_00000008"
    # DCP's future is done on a rank only once the coordinator wrote .metadata, all ranks' data
    metadata_when_done = (tmp / ".metadata").is_file() and len(list(tmp.glob("*.distcp"))) == 2
    dist.barrier()
    written = sorted(p.name for p in tmp.iterdir() if not p.name.endswith(".distcp"))
    restarted = CheckpointManager(directory, async_save=True, process_group=group)
    latest_before = latest_complete(directory)
    dist.barrier()  # every rank has looked before rank 0 cleans up
    restarted.cleanup_partial()
    dist.barrier()
    return dict(rank=rank, written=written, latest_before=latest_before,
                metadata_when_done=metadata_when_done,
                after=sorted(p.name for p in Path(directory).iterdir()))


@pytest.mark.timeout(120)
def test_two_rank_leftover_tmp_is_ignored_and_cleaned_up(tmp_path):
    directory = tmp_path / "ckpts"
    out = run_workers(_interrupted_worker, 2, (str(directory),), timeout=100)
    for r in out:
        # the unrenamed folder holds everything a complete checkpoint has...
        assert r["metadata_when_done"]
        assert r["written"] == [".metadata", "meshtrain.json", "rng_rank0.pt", "rng_rank1.pt",
                                "trainer_state.pt"]
        # ...and is still not taken for one
        assert r["latest_before"] == directory / "step_00000004"
        assert r["after"] == ["step_00000004"]


def _nan_worker(directory, where):
    rank = _init()
    model, optimizer = _model_and_adamw(shard=True)
    _step(model, optimizer, 0)
    mgr = CheckpointManager(directory, every_n_steps=1)
    if rank == 1:  # one element of rank 1's own shard only
        with torch.no_grad():
            if where == "param":
                model[0].weight.to_local()[0, 0] = float("nan")
            else:
                optimizer.state[model[2].bias]["exp_avg_sq"].to_local()[0] = float("inf")
    local_nonfinite = any(not torch.isfinite(p.to_local()).all() for p in model.parameters())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        saved = mgr.save(6, model, optimizer, _trainer_state(6), _summary(6))
    dist.barrier()
    contents = sorted(p.name for p in Path(directory).iterdir()) if Path(directory).exists() else []
    messages = [str(w.message) for w in caught]
    # repaired, the same manager saves again
    model, optimizer = _model_and_adamw(shard=True)
    _step(model, optimizer, 0)
    saved_after = mgr.save(7, model, optimizer, _trainer_state(7), _summary(7))
    return dict(rank=rank, saved=saved, contents=contents, messages=messages,
                local_nonfinite=local_nonfinite, saved_after=saved_after,
                latest=latest_complete(directory))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("where", ["param", "optim"])
def test_two_rank_nan_on_one_rank_refuses_the_save_everywhere(tmp_path, where):
    directory = tmp_path / "ckpts"
    out = run_workers(_nan_worker, 2, (str(directory), where), timeout=100)
    if where == "param":
        assert [r["local_nonfinite"] for r in out] == [False, True]  # rank 0 sees no NaN itself
    for r in out:
        assert r["saved"] is False
        assert r["contents"] == []
        assert any("step 6" in m and "NaN/Inf" in m for m in r["messages"]), r["messages"]
        assert r["saved_after"] is True and r["latest"] == directory / "step_00000007"
