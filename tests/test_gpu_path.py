"""The GPU path on one CUDA device: a one-rank NCCL group under DDP, FSDP2 with CPU offload,
bf16-mixed and fp16-mixed (grad scaler, overflow skip), compile, block timing with CUDA events,
and the allocator's figures in the memory report.

``pytest -m gpu`` on a GPU machine; without a visible CUDA device every test here is skipped with
that reason (CI has none). fp32 runs turn TF32 off, so CPU and GPU differ by kernel rounding only.
The mixed-precision limits are tests/test_mixed_precision.py's (fractions of the format's unit
roundoff u, measured on CPU) except the loss's: on an H200 (torch 2.11, 2026-11-26) the 8-step
run's losses landed 0.149 u (bf16) and 0.190 u (fp16) from fp32 where the CPU's land within
0.023 u, with parameters (0.0093 u) and gradient norms (0.044 u) inside the CPU's limits; cuBLAS's
reduced-precision reductions made no difference. The loss limit here is u/2.
"""

from __future__ import annotations

import re
import tempfile

import pytest
import torch
from parity import GPT4_FNS, GPT_FNS, GRAD_NORMS, compare_ranks, mlp, regression_data, \
    train_state
from test_gpu import no_tf32  # noqa: F401  (autouse: TF32 off in every test here)
from test_mixed_precision import FNS as MP_FNS
from test_mixed_precision import UNIT_ROUNDOFF, _InjectInf, assert_within, limits

from meshtrain.launch.spawn import run_workers

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
COMMON = dict(max_steps=8, global_batch_size=16, log_grad_norm=True)


# -- one-rank NCCL group: DDP, and FSDP2 with CPU offload -----------------------------------------
def _one_rank(kind: str) -> dict:
    """Rank 0 of a one-process NCCL job: 5 SGD steps of the MLP wrapped by meshtrain's
    ``apply_ddp`` or sharded by ``apply_fsdp(offload="cpu")``; returns the parameters on CPU."""
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from meshtrain.launch.spawn import DistEnv, init_process_group
    from meshtrain.parallel.data.data_parallel import apply_ddp
    from meshtrain.parallel.data.fully_shard import apply_fsdp

    torch.backends.cuda.matmul.allow_tf32 = False
    init_process_group(DistEnv.from_environ(), "nccl", timedelta(seconds=60))
    try:
        assert dist.get_backend() == "nccl"
        total = torch.full((3,), 2.0, device="cuda")
        dist.all_reduce(total)
        assert total.tolist() == [2.0] * 3
        torch.manual_seed(0)
        model = mlp().cuda()
        if kind == "ddp":
            mesh = init_device_mesh("cuda", (1,), mesh_dim_names=("dp",))
            train_module = apply_ddp(model, mesh, device=torch.device("cuda", 0))
        else:
            mesh = init_device_mesh("cuda", (1,))
            train_module = apply_fsdp(model, mesh, offload="cpu")
            where = {p.to_local().device.type for p in model.parameters()}
            assert where == {"cpu"}, f"offloaded parameters live on {where}"
        _sgd_steps(train_module, model.parameters(), "cuda")
        return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu()
                for k, v in model.state_dict().items()}
    finally:
        dist.destroy_process_group()


def _sgd_steps(module, params, device: str, steps: int = 5) -> None:
    data = regression_data()
    optimizer = torch.optim.SGD(params, lr=0.05)
    for step in range(steps):
        x, y = (t[16 * step:16 * (step + 1)].to(device) for t in data.tensors)
        torch.nn.functional.mse_loss(module(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()


def _reference_on_cpu() -> dict:
    torch.manual_seed(0)
    model = mlp()
    _sgd_steps(model, model.parameters(), "cpu")
    return model.state_dict()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind", ["ddp", "fsdp-offload"])
def test_one_rank_nccl_group_trains_like_one_cpu_process(kind):
    [state] = run_workers(_one_rank, 1, (kind,), timeout=150)
    reference = _reference_on_cpu()
    assert list(state) == list(reference)
    for name, value in reference.items():
        diff = (state[name] - value).abs().max().item()
        assert diff <= 1e-5, f"{kind}: {name} differs from one CPU process by {diff:.2e}"


# -- mixed precision ----------------------------------------------------------------------------
@pytest.mark.parametrize("precision", ["bf16-mixed", "fp16-mixed"])
def test_mixed_precision_on_cuda_within_the_formats_limits(precision):
    fp32 = train_state(dict(COMMON, accelerator="cpu"), **MP_FNS)
    half = train_state(dict(COMMON, accelerator="cuda", precision=precision), **MP_FNS)
    assert half[GRAD_NORMS].isfinite().all(), "an fp16 step was skipped (inf gradient norm)"
    limit = dict(limits(precision), loss=UNIT_ROUNDOFF[precision] / 2)
    assert_within([half], fp32, limit, f"{precision} on cuda vs fp32 on cpu")


def test_fp16_overflow_on_cuda_skips_the_step_and_halves_the_scale():
    record = _InjectInf()  # rank 0 (the only one here) puts an inf in a gradient in step 2
    state = train_state(dict(COMMON, accelerator="cuda", precision="fp16-mixed",
                             callbacks=[record]), **MP_FNS)
    assert all(torch.equal(v, record.params[2][k]) for k, v in record.params[1].items())
    assert record.scales == [2.0 ** 16] + [2.0 ** 15] * 7
    assert state[GRAD_NORMS][1].isinf() and state[GRAD_NORMS].isfinite().sum() == 7


# -- compile -----------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", [True, "model"])
def test_compile_on_cuda_matches_eager(mode):
    common = dict(COMMON, max_steps=10, accelerator="cuda")
    eager = train_state(common, **GPT_FNS)
    compiled = train_state(dict(common, compile=mode), **GPT_FNS)
    compare_ranks(eager, [compiled], tol=1e-5, label=f"compile={mode!r} on cuda")


# -- block timing with CUDA events --------------------------------------------------------------
def test_block_times_on_cuda_come_from_events_and_rank_the_blocks():
    from meshtrain.parallel.pipeline.partition import _clock_for, _CudaEventClock, block_time_costs

    assert isinstance(_clock_for(torch.device("cuda", 0)), _CudaEventClock)
    small, large = torch.nn.Linear(256, 256), torch.nn.Linear(256, 256)
    blocks = [small.cuda(), torch.nn.Sequential(*[large] * 16).cuda()]  # 16x the work
    costs = block_time_costs(blocks, torch.randn(4096, 256, device="cuda"), repeats=5)
    assert all(c > 0 for c in costs)
    assert costs[1] > 4 * costs[0], f"16x the matmuls timed only {costs[1] / costs[0]:.1f}x"


# -- the memory report --------------------------------------------------------------------------
def test_memory_report_shows_the_cuda_allocator():
    torch.cuda.reset_peak_memory_stats()
    with tempfile.TemporaryDirectory() as run_dir:
        train_state(dict(COMMON, accelerator="cuda", max_steps=2, run_dir=run_dir), **GPT4_FNS)
        text = open(f"{run_dir}/memory.txt").read()
    found = re.search(r"allocated ([\d.]+), peak allocated ([\d.]+), reserved ([\d.]+)", text)
    assert found, text
    allocated, peak, reserved = map(float, found.groups())
    state_total = float(text.splitlines()[3].split()[4])  # the table row's total (MiB)
    assert 0 < state_total <= allocated <= peak <= reserved



# -- the step-time breakdown and MFU (meshtrain/observe/) ---------------------------------------
def test_breakdown_on_cuda_adds_up_and_mfu_uses_the_device_peak():
    """The parts, from CUDA events replayed at each logging interval (no sync per step), add up
    to the loop's clock on the device; the peak is the data sheet's for a known GPU."""
    from meshtrain.observe import run_files
    from meshtrain.observe.flops import GPU_PEAK_TFLOPS

    with tempfile.TemporaryDirectory() as run_dir:
        train_state(dict(COMMON, accelerator="cuda", max_steps=30, log_every_n_steps=10,
                         run_dir=run_dir, loggers=("csv",)), **GPT4_FNS)
        rows = run_files.read_breakdown(run_dir)
        env = run_files.read_json(f"{run_dir}/{run_files.ENVIRONMENT}")
    assert [r["step"] for r in rows] == [10, 20, 30]
    for row in rows[1:]:
        assert row["step_s"] == pytest.approx(row["wall_s"], rel=0.05), row
        assert row["compute_s"] > 0 and row["mem_peak_bytes"] > 0
    name = torch.cuda.get_device_name(0)
    known = [peak for key, peak in GPU_PEAK_TFLOPS if key in name]
    if known:
        assert env["peak_tflops"] == known[0] and name in env["peak_source"]


def test_profile_steps_on_cuda_write_a_memory_snapshot():
    """``profile_steps`` on CUDA: a Chrome trace and the allocator's history of those steps
    (torch.cuda.memory's snapshot, for pytorch.org/memory_viz), with the blocks they held."""
    import pickle

    with tempfile.TemporaryDirectory() as run_dir:
        train_state(dict(COMMON, accelerator="cuda", max_steps=4, profile_steps=[2, 3],
                         run_dir=run_dir), **GPT4_FNS)
        with open(f"{run_dir}/traces/memory_rank0.pickle", "rb") as f:
            snapshot = pickle.load(f)
        assert (tempfile.os.path.exists(f"{run_dir}/traces/rank0.json"))
    assert snapshot["segments"] and any(trace for trace in snapshot["device_traces"])
    assert any(event["action"] == "alloc" for event in snapshot["device_traces"][0])
