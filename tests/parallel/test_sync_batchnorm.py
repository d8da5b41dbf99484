"""Synchronised BatchNorm and gather_batch: on 2 gloo ranks, outputs, input and parameter
gradients and running statistics equal one process on the whole batch; eval mode runs no
collective; names, state_dict, deepcopy and pickling survive the conversion. Negative controls (a
plain BatchNorm per rank, a gather whose backward does not sum over ranks) show the checks fail."""

import copy
import pickle
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from conftest import end_together, join_gloo
from torch import nn

from meshtrain.errors import ConfigError
from meshtrain.launch.spawn import run_workers
from meshtrain.parallel.data.batch_gather import (
    batch_group,
    current_batch_group,
    gather_batch,
)
from meshtrain.parallel.data.sync_batchnorm import apply_sync_batchnorm

TOL = 1e-5
STEPS = 2
# name: (module factory, global input shape, rows of rank 0 and rank 1)
CASES = {
    "bn1d_nc": (partial(nn.BatchNorm1d, 3), (8, 3), (4, 4)),
    "bn1d_ncl": (partial(nn.BatchNorm1d, 3), (6, 3, 5), (3, 3)),
    "bn2d_uneven": (partial(nn.BatchNorm2d, 3), (7, 3, 4, 4), (3, 4)),
    "momentum_none": (partial(nn.BatchNorm2d, 3, momentum=None), (6, 3, 2, 2), (3, 3)),
}


def make(name):
    module = CASES[name][0]()
    with torch.no_grad():  # not 1 and 0: parameter gradients then show more
        module.weight.copy_(torch.linspace(0.5, 1.5, 3))
        module.bias.copy_(torch.linspace(-1.0, 1.0, 3))
    return module


def data(name, step, rank=None):
    """Input and loss weights of one step; the rows of ``rank`` if given."""
    shape, split = CASES[name][1], CASES[name][2]
    gen = torch.Generator().manual_seed(100 * step + len(name))
    x, w = torch.randn(shape, generator=gen) * 2 + 3, torch.randn(shape, generator=gen)
    if rank is None:
        return x, w
    start = sum(split[:rank])
    return x[start:start + split[rank]], w[start:start + split[rank]]


def train(module, name, rank=None):
    """STEPS training steps with loss sum(y * w): each step's output and gradients, and the
    final buffers."""
    steps = []
    for step in range(STEPS):
        x, w = data(name, step, rank)
        x.requires_grad_(True)
        module.zero_grad()
        y = module(x)
        (y * w).sum().backward()
        steps.append((y.detach(), x.grad, module.weight.grad.clone(), module.bias.grad.clone()))
    return steps, {k: v.clone() for k, v in module.named_buffers()}


def _bn_rank():
    import torch.distributed as dist

    rank, _ = join_gloo()
    results = {}
    for name in CASES:
        module = make(name)
        assert apply_sync_batchnorm(module, dist.group.WORLD) == 1
        results[name] = train(module, name, rank)
    results["plain"] = train(make("bn1d_nc"), "bn1d_nc", rank)  # negative control: no sync
    results["float64"] = _float64_step(rank)
    # eval: the original module's output, and no collective
    x = data("bn2d_uneven", 0, rank)[0]
    plain = make("bn2d_uneven")
    plain.load_state_dict(module.state_dict())
    calls, all_reduce = [], dist.all_reduce
    dist.all_reduce = lambda *a, **k: calls.append(1) or all_reduce(*a, **k)
    try:
        results["eval"] = (torch.equal(module.eval()(x), plain.eval()(x)), len(calls))
    finally:
        dist.all_reduce = all_reduce
    # deepcopy keeps the group (same training output); pickling drops it (local statistics)
    module.train()
    twin = copy.deepcopy(module)
    unpickled = pickle.loads(pickle.dumps(module))
    results["copies"] = (
        twin._sync_group.group is dist.group.WORLD,
        torch.equal(twin(x), module(x)),
        torch.equal(unpickled(x), make("bn2d_uneven").train()(x)),
    )
    return end_together(results)


def _float64_step(rank=None):
    """One training forward of a float64 BatchNorm2d: its output and running variance."""
    module = make("bn2d_uneven").double()
    if rank is not None:
        import torch.distributed as dist

        apply_sync_batchnorm(module, dist.group.WORLD)
    x = data("bn2d_uneven", 0, rank)[0].double()
    return module(x).detach(), module.running_var.clone()


@pytest.mark.timeout(120)
def test_a_float64_model_keeps_float64(bn_results):
    """It computed in float32 (x.float()) whatever the model's dtype: off by ~1e-7."""
    y, running_var = _float64_step()
    split = CASES["bn2d_uneven"][2]
    got = torch.cat([r["float64"][0] for r in bn_results])
    assert got.dtype == torch.float64
    assert (got - y).abs().max() <= 1e-12
    for result in bn_results:
        assert (result["float64"][1] - running_var).abs().max() <= 1e-12
    assert [len(r["float64"][0]) for r in bn_results] == list(split)


@pytest.fixture(scope="module")
def bn_results():
    return run_workers(_bn_rank, 2, timeout=60)


def check_matches_one_process(name, results):
    expected, expected_buffers = train(make(name), name)
    split = CASES[name][2]
    for step, (y, x_grad, w_grad, b_grad) in enumerate(expected):
        rows = [0, split[0], sum(split)]
        for rank, (steps, _) in enumerate(results):
            got = steps[step]
            assert (got[0] - y[rows[rank]:rows[rank + 1]]).abs().max() <= TOL, (name, step)
            assert (got[1] - x_grad[rows[rank]:rows[rank + 1]]).abs().max() <= TOL, (name, step)
        # each rank's loss is its part of the global sum: parameter gradients add up
        assert (sum(r[0][step][2] for r in results) - w_grad).abs().max() <= TOL, (name, step)
        assert (sum(r[0][step][3] for r in results) - b_grad).abs().max() <= TOL, (name, step)
    for _, buffers in results:
        assert buffers.keys() == expected_buffers.keys()
        for key, value in expected_buffers.items():
            assert (buffers[key].double() - value.double()).abs().max() <= TOL, (name, key)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", list(CASES))
def test_sync_batchnorm_matches_one_process(bn_results, name):
    check_matches_one_process(name, [r[name] for r in bn_results])


@pytest.mark.timeout(120)
def test_plain_batchnorm_per_rank_differs(bn_results):
    with pytest.raises(AssertionError):
        check_matches_one_process("bn1d_nc", [r["plain"] for r in bn_results])


@pytest.mark.timeout(120)
def test_eval_is_unchanged_and_copies(bn_results):
    for result in bn_results:
        assert result["eval"] == (True, 0)
        assert result["copies"] == (True, True, True)


def test_conversion_keeps_names_state_and_local_behaviour():
    model = nn.Sequential(nn.BatchNorm1d(3), nn.Sequential(nn.BatchNorm2d(3)),
                          nn.BatchNorm3d(3), nn.SyncBatchNorm(3), nn.Linear(3, 3))
    originals = [type(m) for m in model]
    reference = copy.deepcopy(model)
    keys = list(model.state_dict())
    assert apply_sync_batchnorm(model, None) == 4
    assert apply_sync_batchnorm(model, None) == 4  # again: no subclass of a subclass
    assert list(model.state_dict()) == keys
    for module, original in zip(model, originals, strict=True):
        assert isinstance(module, original)
        assert type(module).__mro__[2] is original or type(module) is original
    twin, unpickled = copy.deepcopy(model), pickle.loads(pickle.dumps(model))
    assert list(twin.state_dict()) == list(unpickled.state_dict()) == keys
    x, x3 = torch.randn(4, 3), torch.randn(2, 3, 2, 2, 2)
    for bn, ref in ((model[0], reference[0]), (model[2], reference[2]), (model[3], reference[3])):
        for mode in (True, False):  # training without a group, and eval: the original's output
            inp = x if bn is model[0] else x3
            assert torch.equal(bn.train(mode)(inp), ref.train(mode)(inp))
        assert all(torch.equal(a, b) for a, b in zip(bn.buffers(), ref.buffers(), strict=True))
    with pytest.raises(ConfigError, match="nn.Module"):
        apply_sync_batchnorm("model", None)


# ---- gather_batch ---------------------------------------------------------------------------
def clip_grads(inputs, gather):
    """Gradients of a symmetric CLIP loss: local queries against the gathered keys and back."""
    torch.manual_seed(0)
    q_enc, k_enc = nn.Linear(4, 3), nn.Linear(4, 3)
    q, k = F.normalize(q_enc(inputs), dim=1), F.normalize(k_enc(inputs), dim=1)
    (q_all, rows), (k_all, _) = gather(q), gather(k)
    labels = torch.arange(rows.start, rows.stop)
    loss = (F.cross_entropy(q @ k_all.T / 0.1, labels)
            + F.cross_entropy(k @ q_all.T / 0.1, labels)) / 2
    loss.backward()
    return {f"{e}.{n}": p.grad for e, m in (("q", q_enc), ("k", k_enc))
            for n, p in m.named_parameters()}


def clip_inputs():
    return torch.randn(8, 4, generator=torch.Generator().manual_seed(1))


def _no_sum_gather(x):  # negative control: the backward keeps only this rank's own gradient
    import torch.distributed as dist

    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x.detach().contiguous())
    parts[dist.get_rank()] = x
    return torch.cat(parts), slice(dist.get_rank() * len(x), (dist.get_rank() + 1) * len(x))


def _gather_rank():
    import torch.distributed as dist

    rank, _ = join_gloo()
    local = clip_inputs()[4 * rank:4 * rank + 4]
    with batch_group(dist.group.WORLD):
        result = {"grads": clip_grads(local, gather_batch)}
        with batch_group(None):
            result["nested"] = gather_batch(local)[0] is local
        result["restored"] = current_batch_group() is dist.group.WORLD
        try:
            gather_batch(torch.zeros(3 + rank, 2))
        except ConfigError as error:
            result["sizes"] = str(error)
    result["no_sum"] = clip_grads(local, _no_sum_gather)
    return end_together(result)


@pytest.mark.timeout(120)
def test_gather_batch_clip_loss_matches_one_process():
    results = run_workers(_gather_rank, 2, timeout=60)
    expected = clip_grads(clip_inputs(), gather_batch)  # one process: gather_batch is the identity
    for key in ("grads", "no_sum"):
        mean = {n: sum(r[key][n] for r in results) / 2 for n in expected}
        worst = max((mean[n] - expected[n]).abs().max().item() for n in expected)
        assert (worst <= TOL) == (key == "grads"), (key, worst)
    for result in results:
        assert result["nested"] and result["restored"]
        assert "0: (3, 2), 1: (4, 2)" in result["sizes"]


def test_gather_batch_one_process_is_identity():
    x = torch.randn(5, 2)
    gathered, rows = gather_batch(x)
    assert gathered is x and rows == slice(0, 5)
    with batch_group(None):
        assert gather_batch(x)[0] is x
    with pytest.raises(ConfigError, match="ProcessGroup"), batch_group("dp"):
        pass
