"""FSDP2's tuned collectives (meshtrain/parallel/data/fsdp_comm.py): the all-to-all reduce-scatter
gives gloo's own results, apply_fsdp installs it (and explicit prefetch) on every FSDP module of
a gloo job, blocks are grouped into units, and zero2 gathers once per step."""

import pytest
import torch
from conftest import end_together, gloo_mesh

from meshtrain.launch.spawn import run_workers


def _comm_worker():
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    from meshtrain.parallel.data.fsdp_comm import AllToAllReduceScatter
    from meshtrain.parallel.data.fully_shard import apply_fsdp

    mesh = gloo_mesh((2,), ("dp_shard",))
    group, rank = mesh.get_group(), dist.get_rank()
    gen = torch.Generator().manual_seed(rank)
    comm = AllToAllReduceScatter()
    results = {}
    for name, op in (("sum", dist.ReduceOp.SUM), ("avg", dist.ReduceOp.AVG),
                     ("max", dist.ReduceOp.MAX)):  # max: falls back to gloo's own
        x = torch.randn(2 * 37, generator=gen)
        ours, gloo = comm.allocate((37,), dtype=x.dtype, device=x.device), torch.empty(37)
        assert comm(ours, x.clone(), group, op) is None
        dist.reduce_scatter_single(gloo, x.clone(), group=group, op=op)
        results[name] = (ours - gloo).abs().max().item()

    # the same through shared memory (shm/p2p.py), all-gather too, synchronous and async
    from meshtrain.parallel.shm import p2p as shm_p2p
    from meshtrain.parallel.data.fsdp_comm import SharedMemoryAllGather

    p2p = shm_p2p.local_p2p_group([[0, 1]], torch.device("cpu"), "auto")
    shm_comm = AllToAllReduceScatter(p2p=p2p)
    for name, op in (("shm sum", dist.ReduceOp.SUM), ("shm avg", dist.ReduceOp.AVG)):
        x = torch.randn(2 * 37, generator=gen)
        ours, gloo = torch.empty(37), torch.empty(37)
        assert shm_comm(ours, x.clone(), group, op) is None
        dist.reduce_scatter_single(gloo, x.clone(), group=group, op=op)
        results[name] = (ours - gloo).abs().max().item()
    for async_op in (False, True):
        mine = torch.randn(37, generator=gen)
        ours, gloo = torch.empty(2 * 37), [torch.empty(37), torch.empty(37)]
        work = SharedMemoryAllGather(p2p)(ours, mine, group, async_op=async_op)
        if async_op:
            work.wait()
        dist.all_gather(gloo, mine, group=group)
        results[f"shm gather {async_op}"] = torch.equal(ours, torch.cat(gloo))

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    apply_fsdp(model, mesh)
    first, second = (module._get_fsdp_state() for module in model)
    results["prefetch"] = (first._states_to_forward_prefetch == [second],
                           second._states_to_backward_prefetch == [first],
                           all(g.unshard_async_op for s in (first, second)
                               for g in s._fsdp_param_groups))
    results["installed"] = sorted(
        type(group_._reduce_scatter_comm).__name__
        for module in model.modules() if isinstance(module, FSDPModule)
        for group_ in module._get_fsdp_state()._fsdp_param_groups)
    return end_together(results)


@pytest.mark.timeout(120)
def test_all_to_all_reduce_scatter_matches_gloo_and_is_installed():
    for result in run_workers(_comm_worker, 2, timeout=100):
        assert result["sum"] < 1e-6 and result["avg"] < 1e-6 and result["max"] == 0
        assert result["shm sum"] < 1e-6 and result["shm avg"] < 1e-6
        assert result["shm gather False"] and result["shm gather True"]
        # each block's forward starts the next one's gather, each backward the previous one's
        assert result["prefetch"] == (True, True, True)
        # both Linear blocks; the root holds no parameters of its own, so it has no group
        assert result["installed"] == ["AllToAllReduceScatter"] * 2


def _gathers_worker(layout: str, unit_mb, local_comm: str):
    import tempfile

    import torch.nn.functional as F
    from torch.utils.data import TensorDataset

    from meshtrain import Trainer
    from meshtrain.parallel.data import fsdp_comm

    calls = []

    def counting(cls):
        original = cls.__call__

        def counted(self, *args, **kwargs):
            calls.append(type(self).__name__)
            return original(self, *args, **kwargs)
        return counted

    for cls in (fsdp_comm.BroadcastAllGather, fsdp_comm.SharedMemoryAllGather):
        cls.__call__ = counting(cls)
    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(32, 4, generator=gen), torch.randn(32, 4, generator=gen))
    with tempfile.TemporaryDirectory() as run_dir:
        trainer = Trainer(layout=layout, accelerator="cpu", max_steps=2, global_batch_size=16,
                          micro_batch_size=2, loggers=(), progress_bar=False, run_dir=run_dir,
                          save_final_checkpoint=False, shard_unit_mb=unit_mb,
                          local_comm=local_comm)
        trainer.fit(lambda: torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)),
                    data, optimizer=lambda p: torch.optim.SGD(p, lr=0.1), loss_fn=F.mse_loss)
    return end_together(calls)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("layout, unit_mb, per_step, local_comm", [
    ("zero2=2", None, 2, "auto"), ("zero3=2", None, (4 + 4) + 4, "auto"),
    ("zero3=2", 4.0, 4, "backend")])
def test_all_gathers_per_step(layout, unit_mb, per_step, local_comm):
    # 2 steps x 4 micro-batches, 2 tiny Linear blocks (the root has no parameters of its own).
    # One unit per block: zero2 gathers each block once per step, keeping it gathered between
    # the micro-batches; zero3 in each micro-batch's forward and backward, except the last
    # block, kept from forward to backward: (4 + 4) + 4 per step. Blocks grouped into units
    # of 4 MiB (the default): both blocks are one unit, the last: 4 per step
    # (through shared memory on CPU processes of one host, or with local_comm="backend" gloo's
    # broadcasts)
    kind = "SharedMemoryAllGather" if local_comm == "auto" else "BroadcastAllGather"
    for calls in run_workers(_gathers_worker, 2, (layout, unit_mb, local_comm), timeout=100):
        assert calls == [kind] * (2 * per_step)


def test_blocks_are_grouped_into_units_of_at_least_the_minimum():
    from meshtrain.parallel.data.fully_shard import group_blocks

    sizes = [1, 1, 3, 1, 5, 1]
    assert group_blocks(sizes, 2, size=lambda b: b) == [[1, 1], [3], [1, 5], [1]]
    assert group_blocks(sizes, 0, size=lambda b: b) == [[b] for b in sizes]
    blocks = [torch.nn.Linear(4, 4) for _ in range(3)]  # 80 bytes of parameters each
    assert group_blocks(blocks, 160) == [blocks[:2], blocks[2:]]
