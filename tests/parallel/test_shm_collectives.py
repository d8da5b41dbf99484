"""The tp axis's collectives through shared memory (meshtrain/parallel/shm/collectives.py): every
collective the group is asked for gives gloo's result (functional or not, DTensor's), the same
bits on every rank, the rest goes to gloo, a missing rank times out; the Trainer gives it to
the tp axis on CPU (the tensor-parallel parity tests run on it; one of them on gloo instead)."""

from datetime import timedelta

import pytest
import torch
from conftest import end_together, join_gloo
from parity import GPT_FNS, assert_parity

from meshtrain.launch.spawn import run_workers


def _collectives_worker():
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    from meshtrain.parallel.shm import collectives as shm_collectives

    rank, n = join_gloo()
    group = dist.new_group(list(range(n)), backend=shm_collectives.BACKEND)
    gloo = dist.new_group(list(range(n)), backend="gloo")
    gen = torch.Generator().manual_seed(rank)
    checks: dict[str, bool] = {}
    seen: dict[str, torch.Tensor] = {}  # results every rank must hold bit for bit

    def both(make, run):
        """``run`` on a copy through each group: (shared memory's, gloo's)."""
        a, b = make(), None
        b = a.clone()
        return run(a, group), run(b, gloo)

    def reduced(op):
        def run(t, g):
            dist.all_reduce(t, op=op, group=g)
            return t
        return run

    x = torch.randn(1001, generator=gen)  # 1001: chunks of unequal size on 3 ranks
    ours, theirs = both(lambda: x.clone(), reduced(dist.ReduceOp.SUM))
    checks["all_reduce sum"] = torch.allclose(ours, theirs, atol=1e-6)
    seen["sum"] = ours
    avg = x.clone()
    dist.all_reduce(avg, op=dist.ReduceOp.AVG, group=group)  # (gloo has no average)
    checks["all_reduce avg"] = torch.allclose(avg, theirs / n, atol=1e-6)
    seen["avg"] = avg
    for op in (dist.ReduceOp.MAX, dist.ReduceOp.MIN, dist.ReduceOp.PRODUCT):
        ours, theirs = both(lambda: x.clone(), reduced(op))
        checks[f"all_reduce {op}"] = torch.allclose(ours, theirs, rtol=1e-6, atol=0)
        seen[f"{op}"] = ours
    ints = torch.randint(-1000, 1000, (37,), generator=gen)
    ours, theirs = both(lambda: ints.clone(), reduced(dist.ReduceOp.MAX))
    checks["all_reduce max int64"] = torch.equal(ours, theirs)
    ours, theirs = both(lambda: ints.clone(), reduced(dist.ReduceOp.SUM))
    checks["all_reduce int64"] = torch.equal(ours, theirs)
    grid = torch.randn(6, 5, generator=gen)
    ours, theirs = both(lambda: grid.clone().t(), reduced(dist.ReduceOp.SUM))  # not contiguous
    checks["all_reduce transposed"] = torch.allclose(ours, theirs, atol=1e-6)

    part = torch.randn(4, 3, generator=gen)
    gathered = torch.empty(4 * n, 3)
    dist.all_gather_into_tensor(gathered, part, group=group)
    expected = torch.empty(4 * n, 3)
    dist.all_gather_into_tensor(expected, part, group=gloo)
    checks["all_gather_into_tensor"] = torch.equal(gathered, expected)
    checks["funcol all_gather"] = torch.equal(
        funcol.wait_tensor(funcol.all_gather_tensor(part, 0, group)), expected)

    whole = torch.randn(2 * n, 5, generator=gen)
    total = whole.clone()
    dist.all_reduce(total, group=gloo)
    mine = total.chunk(n)[rank]
    out = torch.empty(2, 5)
    dist.reduce_scatter_tensor(out, whole, group=group)
    checks["reduce_scatter_tensor sum"] = torch.allclose(out, mine, atol=1e-6)
    for op, want in (("sum", mine), ("avg", mine / n)):
        got = funcol.wait_tensor(funcol.reduce_scatter_tensor(whole, op, 0, group))
        checks[f"funcol reduce_scatter {op}"] = torch.allclose(got, want, atol=1e-6)
    peak = whole.clone()
    dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=gloo)
    dist.reduce_scatter_tensor(out, whole, op=dist.ReduceOp.MAX, group=group)
    checks["reduce_scatter max"] = torch.equal(out, peak.chunk(n)[rank])
    flags = torch.tensor([rank % 2 == 0, True, False])  # booleans: gloo's, delegated
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    checks["all_reduce bool"] = flags.tolist() == [True, True, False]
    checks["funcol all_reduce"] = torch.allclose(
        funcol.wait_tensor(funcol.all_reduce(x, "sum", group)), seen["sum"], atol=0)

    # an async caller's future (DDP's comm hooks chain on it) holds the outputs, as gloo's
    y = torch.ones(3)
    future = dist.all_reduce(y, group=group, async_op=True).get_future()
    checks["future"] = torch.equal(future.wait()[0], torch.full((3,), float(n)))

    # on a later dim (sequence parallel's): chunks received into and sent from strided places
    act = torch.randn(3, 2 * n, 5, generator=gen)  # (batch, sequence, width)
    everyone = [torch.empty_like(act) for _ in range(n)]
    dist.all_gather(everyone, act, group=gloo)
    on_dim = torch.empty(3, 2 * n * n, 5)
    group.all_gather_on(on_dim, act, 1)
    checks["all_gather_on dim 1"] = torch.equal(on_dim, torch.cat(everyone, dim=1))
    shard = torch.empty(3, 2, 5)
    group.reduce_scatter_on(shard, act, 1)
    checks["reduce_scatter_on dim 1"] = torch.allclose(
        shard, sum(everyone).chunk(n, dim=1)[rank], atol=1e-6)

    # what goes to gloo as it is
    box = [rank * 10 if rank == 0 else None]
    dist.broadcast_object_list(box, group=group, group_src=0)
    objects = [None] * n
    dist.all_gather_object(objects, rank, group=group)
    dist.barrier(group=group)
    checks["delegated"] = box == [0] and objects == list(range(n))
    checks["registered"] = (dist.distributed_c10d._resolve_process_group(group.group_name)
                            is group and dist.get_rank(group) == rank
                            and dist.get_backend(group) == shm_collectives.BACKEND)

    # DTensor on a mesh whose axis is this backend
    mesh = init_device_mesh("cpu", (n,), mesh_dim_names=("tp",),
                            backend_override={"tp": shm_collectives.BACKEND})
    checks["mesh group"] = isinstance(mesh.get_group("tp"),
                                      shm_collectives.SharedMemoryCollectives)
    full = torch.arange(6.0 * n).view(2 * n, 3)
    local = full.chunk(n)[rank].clone()
    sharded = DTensor.from_local(local, mesh, [Shard(0)])
    checks["dtensor shard->replicate"] = torch.equal(
        sharded.redistribute(mesh, [Replicate()]).to_local(), full)
    partial = DTensor.from_local(torch.full((2 * n, 3), float(rank + 1)), mesh, [Partial()])
    want = float(n * (n + 1) // 2)
    checks["dtensor partial->shard"] = bool(
        (partial.redistribute(mesh, [Shard(0)]).to_local() == want).all())
    checks["dtensor partial->replicate"] = bool(
        (partial.redistribute(mesh, [Replicate()]).to_local() == want).all())
    # bits: every rank's copy of every replicated result
    for name, value in seen.items():
        copies = [torch.empty_like(value) for _ in range(n)]
        dist.all_gather(copies, value, group=gloo)
        checks[f"same bits: {name}"] = all(torch.equal(c, value) for c in copies)
    return end_together(checks)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("ranks", [2, 3])  # one exchange; reduce-scatter + all-gather
def test_every_collective_matches_gloo_with_the_same_bits_on_every_rank(ranks):
    for checks in run_workers(_collectives_worker, ranks, timeout=100):
        assert checks and all(checks.values()), [k for k, ok in checks.items() if not ok]


def _timeout_worker():
    import time

    import torch.distributed as dist

    from meshtrain.fault import set_collective_timeout
    from meshtrain.parallel.shm import collectives as shm_collectives

    join_gloo()
    group = dist.new_group([0, 1], backend=shm_collectives.BACKEND)  # 30 min by default
    # every group but the default one (the test's last barrier waits on it), this one too
    set_collective_timeout(timedelta(seconds=1), skip=dist.distributed_c10d._get_default_group())
    error, t0 = None, time.perf_counter()
    if dist.get_rank() == 1:  # rank 0 never joins
        try:
            dist.all_reduce(torch.ones(3), group=group)
        except RuntimeError as e:
            error = str(e)
    return end_together((error, time.perf_counter() - t0))


def _mismatch_worker():
    import torch.distributed as dist

    from meshtrain.parallel.shm import collectives as shm_collectives

    rank, _ = join_gloo()
    group = dist.new_group([0, 1], backend=shm_collectives.BACKEND)
    error = None
    try:  # the ranks disagree on the size: a desync
        dist.all_reduce(torch.ones(3 + rank), group=group)
    except RuntimeError as e:
        error = str(e)
    return end_together(error)


@pytest.mark.timeout(60)
def test_a_collective_of_another_size_on_each_rank_is_an_error_naming_both():
    for rank, error in enumerate(run_workers(_mismatch_worker, 2, timeout=50)):
        mine, theirs = 4 * (3 + rank), 4 * (3 + 1 - rank)
        assert f"({theirs} bytes)" in error.replace("tag 0, ", "") and f"{mine} bytes" in error
        assert "desync" in error


@pytest.mark.timeout(60)
def test_a_rank_that_never_joins_times_out_after_the_collective_timeout():
    _, (error, seconds) = run_workers(_timeout_worker, 2, timeout=50)
    assert "nothing arrived from rank 0" in error and "within 1 s" in error
    assert 0.9 < seconds < 10


def _trainer_worker(local_comm: str):
    import tempfile
    from collections import Counter

    import torch.distributed as dist
    from parity import GPT_FNS

    from meshtrain import Trainer
    from meshtrain.parallel.shm.collectives import SharedMemoryCollectives

    calls = Counter()  # the sequence dim's exchanges the shared-memory group runs itself
    for name in ("all_gather_on", "reduce_scatter_on"):
        def counted(self, *args, _name=name, _method=getattr(SharedMemoryCollectives, name),
                    **kwargs):
            calls[_name] += args[2] == 1  # on the sequence dim (dim 0: c10d's own calls)
            return _method(self, *args, **kwargs)
        setattr(SharedMemoryCollectives, name, counted)
    trainer = Trainer(layout="tp=2", max_steps=1, global_batch_size=4, loggers=(),
                      progress_bar=False, save_final_checkpoint=False, seed=0,
                      run_dir=tempfile.mkdtemp(), local_comm=local_comm, sequence_parallel=True)
    trainer.fit(GPT_FNS["model_fn"], GPT_FNS["data_fn"](), optimizer=GPT_FNS["optimizer_fn"],
                loss_fn=GPT_FNS["loss_fn"])
    return end_together((dist.get_backend(trainer.mesh.mesh.get_group("tp")), dict(calls)))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("local_comm, backend", [("auto", "meshtrain_shm"),
                                                  ("backend", "gloo")])
def test_the_trainer_gives_the_tp_axis_shared_memory_on_cpu(local_comm, backend):
    for used, calls in run_workers(_trainer_worker, 2, (local_comm,), timeout=100):
        assert used == backend
        if local_comm == "auto":  # sequence parallel's gathers and scatters went through it:
            # per block 2 of each forward and 2 backward (2 blocks), the head's gather (+ its
            # backward's scatter)
            assert calls["all_gather_on"] == calls["reduce_scatter_on"] == 4 * 2 + 1
        else:
            assert sum(calls.values()) == 0


def _checked_worker():
    import torch.distributed as dist

    from meshtrain.fault.desync import enable_collective_checks
    from meshtrain.parallel.layout import Layout
    from meshtrain.parallel.mesh import ParallelMesh

    enable_collective_checks()  # debug_collectives: torch's checks wrap gloo's groups only
    join_gloo()
    mesh = ParallelMesh(Layout.parse("tp=2", 2), "cpu")
    return end_together(dist.get_backend(mesh.mesh.get_group("tp")))


@pytest.mark.timeout(60)
def test_under_collective_checks_the_tp_axis_keeps_gloo():
    assert run_workers(_checked_worker, 2, timeout=50) == ["gloo"] * 2


@pytest.mark.timeout(200)
def test_sequence_parallel_on_gloo_collectives_matches_one_process():
    # (test_tensor_parallel_trainer.py runs every tp layout on the shared-memory group)
    assert_parity("tp=2", 2, steps=5, fns=GPT_FNS,
                  parallel_kwargs=dict(sequence_parallel=True, local_comm="backend"))


def _probed_once_worker():
    import torch.distributed as dist

    from meshtrain.parallel.shm import p2p as shm_p2p
    from meshtrain.parallel.layout import Layout
    from meshtrain.parallel.mesh import ParallelMesh

    join_gloo()
    probes, probe = [], shm_p2p.can_share_memory
    shm_p2p.can_share_memory = lambda *a: probes.append(1) or probe(*a)
    mesh = ParallelMesh(Layout.parse("tp=2", 2), "cpu")  # the tp axis's backend asks
    group = mesh.local_p2p(("tp",), torch.device("cpu"))  # so do the p2p groups: asked once
    return end_together((len(probes), dist.get_backend(mesh.mesh.get_group("tp")),
                         type(group).__name__))


@pytest.mark.timeout(60)
def test_the_mesh_probes_shared_memory_once_for_all_its_groups():
    assert run_workers(_probed_once_worker, 2, timeout=50) == [
        (1, "meshtrain_shm", "LocalP2PGroup")] * 2
