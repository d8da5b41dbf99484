"""Per-rank model-state memory: the ZeRO formulas, and measurements that match them."""

import os
import tempfile
import time

import pytest
import torch
from torch.utils.data import TensorDataset

from meshtrain.launch.spawn import run_workers
from meshtrain.observe.memory.probe import (
    ForwardParamBytes,
    MemoryProbe,
    MemoryRow,
    ModelStateBytes,
    format_memory_table,
    memory_summary,
    model_state_bytes,
    optimizer_bytes_per_param,
    predicted_bytes,
    shard_count,
)
from meshtrain.parallel.layout import Layout

# An MLP of equal Linear layers: every dim 0 divides 1, 2 and 4 (no FSDP2 padding), and ZeRO-1's
# greedy partition gives each of 2 or 4 ranks the same share (whole weights + whole biases).
WIDTH, DEPTH = 64, 4
PSI = DEPTH * (WIDTH * WIDTH + WIDTH)  # 16,640 parameters
NUM_TENSORS = 2 * DEPTH  # parameter tensors: one 4-byte AdamW step counter each
LAYOUTS = ("dp", "zero1", "zero2", "zero3")


def mlp() -> torch.nn.Module:
    layers = []
    for _ in range(DEPTH):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers)


def one_adamw_step(model):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(8, WIDTH)).square().mean().backward()
    opt.step()
    return opt


# -------------------------------------------------------------------------------------------------
# formulas
# -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 2, 4])
def test_predicted_bytes_follow_the_zero_stages(n):
    psi = 1_000_000
    assert predicted_bytes(psi, 0, n) == ModelStateBytes(4_000_000, 4_000_000, 8_000_000)
    assert predicted_bytes(psi, 1, n) == ModelStateBytes(4_000_000, 4_000_000, 8_000_000 // n)
    assert predicted_bytes(psi, 2, n) == ModelStateBytes(4_000_000, 4_000_000 // n, 8_000_000 // n)
    assert predicted_bytes(psi, 3, n) == ModelStateBytes(
        4_000_000 // n, 4_000_000 // n, 8_000_000 // n)


def test_predicted_bytes_exact_numbers():
    psi = 1_000_000
    # fp32 + Adam, total per rank: 16Ψ at stage 0; 4Ψ + 4Ψ + 8Ψ/N, 4Ψ + 12Ψ/N, 16Ψ/N after
    totals = {(s, n): predicted_bytes(psi, s, n).total for s in range(4) for n in (1, 2, 4)}
    assert [totals[0, n] for n in (1, 2, 4)] == [16_000_000] * 3
    assert [totals[1, n] for n in (1, 2, 4)] == [16_000_000, 12_000_000, 10_000_000]
    assert [totals[2, n] for n in (1, 2, 4)] == [16_000_000, 10_000_000, 7_000_000]
    assert [totals[3, n] for n in (1, 2, 4)] == [16_000_000, 8_000_000, 4_000_000]


def test_predicted_bytes_mixed_precision_form_of_the_paper():
    # 2Ψ + 2Ψ + KΨ with K = 12: the paper's 7.5B-parameter example on 64 GPUs
    psi, n = 7_500_000_000, 64
    mixed = dict(bytes_per_param=2, bytes_per_grad=2, optimizer_bytes_per_param=12)
    gb = [predicted_bytes(psi, s, n, **mixed).total / 1e9 for s in range(4)]
    assert gb == pytest.approx([120, 31.4, 16.6, 1.88], rel=0.01)


def test_predicted_bytes_rejects_unknown_stage_and_shards():
    with pytest.raises(ValueError, match="zero_stage"):
        predicted_bytes(10, 4, 2)
    with pytest.raises(ValueError, match="num_shards"):
        predicted_bytes(10, 1, 0)


@pytest.mark.parametrize("spec, world, n", [
    ("dp=4", 4, 1), ("zero1=4", 4, 4), ("zero2=4", 4, 4), ("zero3=4", 4, 4),
    ("dp_shard=2", 2, 2), ("dp_replicate=2,dp_shard=2", 4, 2), ("zero3=1", 1, 1),
])
def test_shard_count_of_layouts(spec, world, n):
    assert shard_count(Layout.parse(spec, world)) == n


# -------------------------------------------------------------------------------------------------
# measured, one process
# -------------------------------------------------------------------------------------------------
def test_plain_model_with_adamw_after_one_step():
    torch.manual_seed(0)
    model = mlp()
    opt = one_adamw_step(model)
    # AdamW keeps a 0-dim fp32 `step` tensor per parameter tensor (so that capturable/fused
    # variants can update it on the device): 4 bytes x 8 tensors on top of momentum + variance.
    expected = ModelStateBytes(4 * PSI, 4 * PSI, 8 * PSI + 4 * NUM_TENSORS)
    assert model_state_bytes(model, opt) == expected
    assert optimizer_bytes_per_param(opt) == 8


def test_nothing_before_backward_and_step():
    model = mlp()
    opt = torch.optim.AdamW(model.parameters())
    assert model_state_bytes(model, opt) == ModelStateBytes(4 * PSI, 0, 0)
    assert model_state_bytes(model) == ModelStateBytes(4 * PSI, 0, 0)


def test_gradient_views_into_one_bucket_count_once():
    # What DDP's gradient_as_bucket_view does: every p.grad is a view into one flat buffer.
    model = mlp()
    bucket = torch.zeros(PSI)
    offset = 0
    for p in model.parameters():
        p.grad = bucket[offset:offset + p.numel()].view_as(p)
        offset += p.numel()
    assert model_state_bytes(model).grads == 4 * PSI


def test_tied_parameters_count_once():
    emb = torch.nn.Embedding(10, 8)
    head = torch.nn.Linear(8, 10, bias=False)
    head.weight = emb.weight
    assert model_state_bytes(torch.nn.ModuleList([emb, head])).params == 4 * 80


def test_optimizer_bytes_per_param_of_common_optimizers():
    for make, k in [(lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), 4),
                    (lambda p: torch.optim.SGD(p, lr=0.1), 0),
                    (lambda p: torch.optim.Adam(p), 8)]:
        model = torch.nn.Linear(4, 4)
        opt = make(model.parameters())
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        assert optimizer_bytes_per_param(opt) == k


def test_forward_param_bytes_records_after_forward():
    model = mlp()
    watch = ForwardParamBytes(model)
    assert watch.bytes is None
    model(torch.randn(2, WIDTH))
    assert watch.bytes == 4 * PSI
    watch.remove()
    assert not model._forward_hooks


def test_format_memory_table_is_aligned_mib():
    mib = 2**20
    rows = [
        MemoryRow("dp=2", ModelStateBytes(4 * mib, 4 * mib, 8 * mib),
                  ModelStateBytes(4 * mib, 4 * mib, 8 * mib)),
        MemoryRow("zero3=2", ModelStateBytes(2 * mib, 2 * mib, 4 * mib),
                  ModelStateBytes(2 * mib, 2 * mib, 2 * mib)),
    ]
    lines = format_memory_table(rows).splitlines()
    assert lines[0].split() == [
        "layout", "params", "grads", "optimizer", "total", "predicted", "ratio"]
    assert lines[2].split() == ["dp=2", "4.00", "4.00", "8.00", "16.00", "16.00", "1.000"]
    assert lines[3].split() == ["zero3=2", "2.00", "2.00", "4.00", "8.00", "6.00", "1.333"]
    assert len({len(line) for line in lines}) == 1


def test_memory_summary_one_process():
    torch.manual_seed(0)
    model = mlp()
    opt = one_adamw_step(model)
    text = memory_summary(model, opt, Layout.parse(None, 1))
    assert "16.64k parameters" in text and "ZeRO stage 0" in text
    assert text.splitlines()[-1].split()[-1] == "1.000"


def test_memory_probe_measures_after_the_first_step_only():
    torch.manual_seed(0)
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    probe = MemoryProbe(model, opt, Layout.parse("zero2=1", 1))
    assert probe.summary() is None
    for _ in range(3):  # the step hook stays (as a no-op) until summary() or remove()
        model(torch.randn(8, WIDTH)).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert probe.row.measured == ModelStateBytes(4 * PSI, 4 * PSI, 8 * PSI + 4 * NUM_TENSORS)
    assert probe.row.predicted == ModelStateBytes(4 * PSI, 4 * PSI, 8 * PSI)  # N = 1
    assert "ZeRO stage 2" in probe.summary()
    assert not model._forward_hooks and not opt._optimizer_step_post_hooks


def _fit_with_probe(layout: str) -> MemoryRow:
    """Train 1 step with Trainer(layout=...); the probe measures after the first step."""
    from meshtrain import Trainer
    from meshtrain.callbacks import Callback

    class Probe(Callback):
        def on_fit_start(self, trainer):
            self.probe = MemoryProbe(trainer.model, trainer.optimizer, trainer.layout)

    os.environ["OMP_NUM_THREADS"] = "1"  # the Trainer keeps one thread per rank then
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, WIDTH, generator=gen),
                         torch.randn(64, WIDTH, generator=gen))
    probe = Probe()
    with tempfile.TemporaryDirectory() as run_dir:
        trainer = Trainer(layout=layout, max_steps=1, global_batch_size=16, loggers=(),
                          progress_bar=False, save_final_checkpoint=False, run_dir=run_dir,
                          callbacks=[probe])
        trainer.fit(mlp, data, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3),
                    loss_fn=torch.nn.functional.mse_loss)
        _drain_collectives()  # while the trainer (and its DDP/FSDP state) is alive
    assert probe.probe.summary() is not None
    return probe.probe.row


def _drain_collectives() -> None:
    """Let gloo's threads retire finished work before the process group can be torn down
    (dropping a DDP reducer while they do has been seen to hang at teardown on torch 2.13)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        time.sleep(0.05)


def _fit_all_layouts(n: int) -> list[MemoryRow]:
    rows = [_fit_with_probe(f"{name}={n}") for name in LAYOUTS]
    if n == 4:  # HSDP: 2 replicas of a model sharded over 2 ranks, so N = dp_shard = 2
        rows.append(_fit_with_probe("dp_replicate=2,dp_shard=2"))
    return rows


def _zero_formula(stage: int, n: int) -> ModelStateBytes:
    """The ZeRO paper's per-rank bytes written out by hand (not with predicted_bytes), fp32 with
    Adam: parameters 4Ψ, gradients 4Ψ, Adam's two moments 8Ψ; stage 1 divides the optimizer
    state by N, stage 2 the gradients too, stage 3 the parameters too."""
    assert PSI % 4 == 0  # every division below is exact for N in 1, 2, 4
    return {
        0: ModelStateBytes(params=4 * PSI, grads=4 * PSI, optimizer=8 * PSI),
        1: ModelStateBytes(params=4 * PSI, grads=4 * PSI, optimizer=8 * PSI // n),
        2: ModelStateBytes(params=4 * PSI, grads=4 * PSI // n, optimizer=8 * PSI // n),
        3: ModelStateBytes(params=4 * PSI // n, grads=4 * PSI // n, optimizer=8 * PSI // n),
    }[stage]


def _expected(stage: int, n: int) -> ModelStateBytes:
    """The formula plus AdamW's step counters of the parameter tensors this rank steps."""
    p = _zero_formula(stage, n)
    steps = 4 * NUM_TENSORS // (n if stage == 1 else 1)  # ZeRO-1: a quarter of the tensors on 4
    return ModelStateBytes(p.params, p.grads, p.optimizer + steps)


def _check(rows_of_ranks: list[list[MemoryRow]], n: int) -> None:
    for rows in rows_of_ranks:
        for stage, row in enumerate(rows[:len(LAYOUTS)]):
            assert row.predicted == _zero_formula(stage, n), row.layout
            # Exact, apart from the step counters; the issue asks for 5%.
            assert row.measured == _expected(stage, n), row.layout
            for got, want in zip(
                (row.measured.params, row.measured.grads, row.measured.optimizer),
                (row.predicted.params, row.predicted.grads, row.predicted.optimizer),
            ):
                assert got == pytest.approx(want, rel=0.05), row.layout


def test_measured_matches_formulas_on_one_process():
    # N = 1: every stage shards nothing, so all four layouts hold 4Ψ + 4Ψ + 8Ψ.
    _check([_fit_all_layouts(1)], 1)


# -------------------------------------------------------------------------------------------------
# measured, N ranks (gloo): dp = DDP, zero1 = DDP + ZeroRedundancyOptimizer, zero2/zero3 = FSDP2
# -------------------------------------------------------------------------------------------------
@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [2, 4])
def test_measured_matches_formulas_on_n_ranks(n):
    """Stage 2's parameters are measured right after forward (full, Ψ); everything else right
    after the first optimizer step, before zero_grad frees the gradients."""
    rows_of_ranks = run_workers(_fit_all_layouts, n, (n,), timeout=110)
    _check(rows_of_ranks, n)
    if n == 4:
        assert all(rows[-1].measured == _expected(3, 2) for rows in rows_of_ranks)
        assert all(rows[-1].predicted == _zero_formula(3, 2) for rows in rows_of_ranks)


def _fsdp2_uneven(n: int):
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from meshtrain.launch.spawn import DistEnv, init_process_group

    init_process_group(DistEnv.from_environ(), "gloo", timedelta(seconds=60))
    mesh = init_device_mesh("cpu", (n,))
    torch.manual_seed(0)
    # dim 0 of 63 and 5 rows: FSDP2 pads each to a multiple of N rows (64 and 6 on 2 ranks)
    model = torch.nn.Sequential(torch.nn.Linear(WIDTH, 63), torch.nn.ReLU(), torch.nn.Linear(63, 5))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = one_adamw_step(model)
    local = sum(p.to_local().numel() for p in model.parameters())
    measured = model_state_bytes(model, opt)
    dist.barrier()
    return local, measured


@pytest.mark.timeout(120)
def test_fsdp2_padding_is_counted():
    """FSDP2 pads each sharded parameter's dim 0 to a multiple of N; the padded storage is what
    the rank holds, so it is counted (params and gradients); optimizer state is unpadded."""
    n = 2
    shapes = [(63, WIDTH), (63,), (5, 63), (5,)]
    psi = sum(torch.Size(s).numel() for s in shapes)
    padded = sum(-(-s[0] // n) * torch.Size(s[1:]).numel() for s in shapes)  # per rank
    results = run_workers(_fsdp2_uneven, n, (n,), timeout=110)
    assert sum(local for local, _ in results) == psi  # the unpadded shards tile the model
    for local, measured in results:
        assert measured.params == 4 * padded and measured.grads == 4 * padded
        assert measured.optimizer == 8 * local + 4 * len(shapes)
        assert measured.params == pytest.approx(4 * psi / n, rel=0.05)


def _tp_row(n: int):
    from datetime import timedelta

    from torch.distributed.device_mesh import init_device_mesh

    from meshtrain.launch.spawn import DistEnv, init_process_group
    from meshtrain.observe.memory.probe import memory_row
    from meshtrain.parallel.tensor.tensor_parallel import apply_tp
    from parity import tiny_gpt

    init_process_group(DistEnv.from_environ(), "gloo", timedelta(seconds=60))
    model = tiny_gpt()
    apply_tp(model, init_device_mesh("cpu", (n,), mesh_dim_names=("tp",))["tp"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randint(0, 16, (4, 8))).float().square().mean().backward()
    opt.step()
    row = memory_row(model, opt, Layout.parse(f"tp={n}", n))
    replicated = sum(p.numel() for p in model.parameters() if p.placements[0].is_replicate())
    return row, replicated


@pytest.mark.timeout(120)
def test_predicted_counts_tensor_parallel_shards():
    """Under tp the rank holds its shards of the split matrices and whole copies of the rest
    (norms): the prediction counts the same (it counted the full model: ratio 0.55)."""
    for row, replicated in run_workers(_tp_row, 2, (2,), timeout=110):
        assert replicated > 0  # the norms: so the check below is not just "divide by tp"
        assert row.ratio == pytest.approx(1.0, abs=0.01), row
