"""FSDP2's tuned collectives (meshtrain/parallel/fsdp_comm.py): the all-to-all reduce-scatter
gives gloo's own results, and apply_fsdp installs it on every FSDP module of a gloo job."""

import pytest
import torch
from conftest import end_together, gloo_mesh

from meshtrain.launch.spawn import run_workers


def _comm_worker():
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    from meshtrain.parallel.fsdp_comm import AllToAllReduceScatter
    from meshtrain.parallel.fully_shard import apply_fsdp

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

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    apply_fsdp(model, mesh)
    results["installed"] = sorted(
        type(group_._reduce_scatter_comm).__name__
        for module in model.modules() if isinstance(module, FSDPModule)
        for group_ in module._get_fsdp_state()._fsdp_param_groups)
    return end_together(results)


@pytest.mark.timeout(120)
def test_all_to_all_reduce_scatter_matches_gloo_and_is_installed():
    for result in run_workers(_comm_worker, 2, timeout=100):
        assert result["sum"] < 1e-6 and result["avg"] < 1e-6 and result["max"] == 0
        # both Linear blocks; the root holds no parameters of its own, so it has no group
        assert result["installed"] == ["AllToAllReduceScatter"] * 2
