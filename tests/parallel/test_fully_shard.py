"""FSDP2 (ZeRO-2/3, HSDP) without the Trainer: apply_fsdp must reproduce one-process training on
the same global batch, and meta-device construction must give the plain model's parameters."""

import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import assert_matches_one_process, gloo_mesh, max_diff

from meshtrain.errors import ConfigError
from meshtrain.launch.spawn import run_workers
from meshtrain.models.gpt import GPT, GPTConfig
from meshtrain.parallel.data.fully_shard import (apply_fsdp, check_offload, find_blocks,
                                                 mixed_precision_policy)
from meshtrain.parallel.data.meta_init import build_on_meta, materialize, supports_meta_init

CONFIG = dict(vocab_size=16, seq_len=8, num_layers=2, d_model=16, num_heads=2)
STEPS, BATCH = 10, 8


def tiny_gpt(seed: int = 0, **overrides) -> GPT:
    return GPT(GPTConfig(**{**CONFIG, **overrides}), seed=seed)


def batches():
    gen = torch.Generator().manual_seed(7)
    x = torch.randint(0, CONFIG["vocab_size"], (STEPS, BATCH, CONFIG["seq_len"]), generator=gen)
    return x, (3 * x + 1) % CONFIG["vocab_size"]  # a learnable map: the loss must fall


def train(model: nn.Module, rank: int = 0, world: int = 1) -> list[float]:
    """AdamW steps on this rank's slice of each global batch; the loss is the mean over it."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    x, y = batches()
    per_rank = BATCH // world
    part = slice(rank * per_rank, (rank + 1) * per_rank)
    losses = []
    for step in range(STEPS):
        logits = model(x[step, part])
        loss = F.cross_entropy(logits.float().flatten(0, 1), y[step, part].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter gathered whole (a collective: every rank must call it)."""
    return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}


def setup_mesh(shape: tuple[int, ...]):
    return gloo_mesh(shape, ("dp_shard",) if len(shape) == 1 else ("dp_replicate", "dp_shard"))


# ---------------------------------------------------------------------------------------------
# find_blocks and options (one process)
# ---------------------------------------------------------------------------------------------
def test_find_blocks_on_gpt_returns_its_layers():
    model = tiny_gpt(num_layers=3)
    assert find_blocks(model) == list(model.layers)


def test_find_blocks_on_sequential_returns_the_linears():
    mlp = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    assert find_blocks(mlp) == [mlp[0], mlp[2], mlp[4]]


def test_find_blocks_returns_nothing_for_a_single_layer():
    assert find_blocks(nn.Linear(4, 4)) == []
    assert find_blocks(nn.Sequential(nn.Linear(4, 4), nn.ReLU())) == []


def test_find_blocks_by_size_takes_the_largest_units_and_looks_into_module_lists():
    model = tiny_gpt()  # embeddings 256 + 128, blocks 3200 each, norm 32, head 256
    block_size = sum(p.numel() for p in model.layers[0].parameters())
    assert find_blocks(model, min_num_params=block_size) == list(model.layers)
    assert find_blocks(model, min_num_params=256) == [
        model.tok_emb, *model.layers, model.head]
    assert find_blocks(model, min_num_params=10 * block_size) == []
    with pytest.raises(ConfigError, match="min_num_params"):
        find_blocks(model, min_num_params=0)


def test_mixed_precision_policies():
    assert mixed_precision_policy("fp32").param_dtype is None
    bf16 = mixed_precision_policy("bf16-mixed")
    assert (bf16.param_dtype, bf16.reduce_dtype) == (torch.bfloat16, torch.float32)
    fp16 = mixed_precision_policy("fp16-mixed")
    assert (fp16.param_dtype, fp16.reduce_dtype) == (torch.float16, torch.float32)
    with pytest.raises(ConfigError, match="fp32, bf16-mixed, fp16-mixed"):
        mixed_precision_policy("bf16")


def test_check_offload_rejects_cpu_offload_without_a_gpu():
    check_offload(None, "cpu")
    check_offload("cpu", "cuda")
    with pytest.raises(ConfigError, match="no GPU here"):
        check_offload("cpu", "cpu")
    with pytest.raises(ConfigError, match="unknown offload"):
        check_offload("nvme", "cuda")


def test_supports_meta_init_and_materialize_needs_init_weights():
    assert supports_meta_init(GPT)
    assert supports_meta_init(tiny_gpt())
    assert supports_meta_init(functools.partial(tiny_gpt, seed=1))
    assert supports_meta_init(lambda: tiny_gpt())
    assert not supports_meta_init(nn.Linear)
    assert not supports_meta_init(lambda: nn.Linear(2, 2))
    linear = build_on_meta(lambda: nn.Linear(2, 2))
    assert linear.weight.is_meta
    with pytest.raises(ConfigError, match="needs init_weights"):
        materialize(linear, "cpu")


def test_gpt_init_weights_on_meta_then_real_matches_constructor():
    model = build_on_meta(lambda: tiny_gpt(seed=3))
    assert all(p.is_meta for p in model.parameters())
    materialize(model, "cpu")  # no sharding: init_weights() reuses the constructor's seed
    assert max_diff(dict(model.named_parameters()), dict(tiny_gpt(seed=3).named_parameters())) == 0


# ---------------------------------------------------------------------------------------------
# Parity with one process (2 and 4 ranks)
# ---------------------------------------------------------------------------------------------
def _parity_rank(shape, reshard_modes):
    mesh = setup_mesh(shape)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    results = []
    for reshard_after_forward in reshard_modes:
        model = apply_fsdp(tiny_gpt(), mesh, reshard_after_forward=reshard_after_forward)
        train(model, rank, world)
        results.append(full_params(model))
    return results if rank == 0 else None


def reference_params() -> dict:
    model = tiny_gpt()
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    train(model)
    final = {n: p.detach() for n, p in model.named_parameters()}
    assert max_diff(initial, final) > 1e-3, "training barely moved: the test would prove nothing"
    return final


@pytest.mark.timeout(120)
def test_zero3_and_zero2_match_one_process():
    zero3, zero2 = run_workers(_parity_rank, 2, ((2,), (True, False)), timeout=100)[0]
    reference = reference_params()
    assert_matches_one_process(reference, zero3, "FSDP (reshard_after_forward=True, ZeRO-3)")
    assert_matches_one_process(reference, zero2, "FSDP (reshard_after_forward=False, ZeRO-2)")


@pytest.mark.timeout(120)
def test_hsdp_2x2_matches_one_process():
    (hsdp,) = run_workers(_parity_rank, 4, ((2, 2), (True,)), timeout=100)[0]
    assert_matches_one_process(reference_params(), hsdp,
                               "HSDP on a 2x2 (dp_replicate, dp_shard) mesh")


# ---------------------------------------------------------------------------------------------
# Meta-device construction, bad arguments, mixed precision (2 ranks)
# ---------------------------------------------------------------------------------------------
def _meta_rank():
    mesh = setup_mesh((2,))
    with pytest.raises(ConfigError, match="no parameters"):
        apply_fsdp(nn.Sequential(nn.ReLU()), mesh)
    linear = nn.Linear(2, 2)
    with pytest.raises(ConfigError, match="blocks contains the model itself"):
        apply_fsdp(linear, mesh, blocks=[linear])
    # vocab 17 and seq 7 shard unevenly over 2 ranks: FSDP2 pads those shards.
    factory = functools.partial(tiny_gpt, seed=5, vocab_size=17, seq_len=7)
    model = apply_fsdp(build_on_meta(factory), mesh)
    allocated = [n for n, p in model.named_parameters() if not p.to_local().is_meta]
    materialize(model, torch.device("cpu"))
    reference = factory()
    diff = max_diff(full_params(model), dict(reference.named_parameters()))
    # FSDP2 must use the materialised values, not the storage to_empty() allocated.
    idx = torch.randint(0, 17, (2, 7), generator=torch.Generator().manual_seed(0))
    out_diff = (model(idx) - reference(idx)).abs().max().item()
    return allocated, diff, out_diff


@pytest.mark.timeout(120)
def test_meta_construction_gives_the_plain_models_parameters():
    for allocated, diff, out_diff in run_workers(_meta_rank, 2, timeout=100):
        assert allocated == [], f"allocated before materialize: {allocated}"
        assert diff == 0
        assert out_diff <= 1e-6


def _bf16_rank():
    mesh = setup_mesh((2,))
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    model = apply_fsdp(tiny_gpt(), mesh, precision="bf16-mixed")
    logits_dtype = model(batches()[0][0, :2]).dtype
    losses = torch.tensor(train(model, rank, world))
    torch.distributed.all_reduce(losses)  # each rank's loss is the mean over its half
    return logits_dtype, {p.dtype for p in model.parameters()}, (losses / world).tolist()


@pytest.mark.timeout(120)
def test_bf16_mixed_precision_stays_close_to_fp32():
    logits_dtype, dtypes, losses = run_workers(_bf16_rank, 2, timeout=100)[0]
    reference = train(tiny_gpt())
    assert logits_dtype == torch.bfloat16  # computed in bf16 ...
    assert dtypes == {torch.float32}  # ... while the sharded master weights stay fp32
    # Before any update only the bf16 forward differs: close.
    assert abs(losses[0] - reference[0]) < 2e-3
    # Loose afterwards: parameters are rounded to bf16 (8-bit mantissa; spacing ~1e-4 at the
    # 0.02 init scale, about the size of one update) for every forward, and AdamW's normalised
    # step turns the ~0.5% gradient error into full-size moves for small gradients. Parameters
    # then differ by ~lr, so the losses are compared instead (seen: up to 0.09 apart).
    assert losses[-1] < losses[0] - 0.5, f"bf16-mixed did not learn: {losses}"
    assert max(abs(a - b) for a, b in zip(losses, reference)) < 0.2, (losses, reference)


def test_which_layouts_build_on_meta_and_why_others_build_whole():
    """A factory of a model with sharded init is built on meta under zero3 and tp, under pp
    when it initialises each module from its name; the reason each rank builds the whole model
    otherwise, as the start prints it."""
    from meshtrain.parallel.data.meta_init import builds_on_meta, whole_build_reason
    from meshtrain.parallel.layout import Layout

    config = GPTConfig(vocab_size=32, seq_len=8, num_layers=2, num_heads=2, d_model=16)
    factory = functools.partial(GPT, config)
    with torch.device("meta"):
        meta = factory()
    for layout in ("zero3=2", "tp=2", "dp_shard=2,tp=2"):
        parsed = Layout.parse(layout, 2 if layout != "dp_shard=2,tp=2" else 4)
        assert builds_on_meta(parsed, "auto", factory, meta), layout
        assert whole_build_reason(parsed, "auto", factory, meta) is None
    assert whole_build_reason(Layout.parse("dp=2", 2), "auto", factory, meta) is None
    class OneSequence(GPT):  # (an init drawing the whole model in one sequence)
        supports_staged_init = False

    assert builds_on_meta(Layout.parse("pp=2", 2), "auto", factory, meta)  # (by name)
    cases = [("pp=2", functools.partial(OneSequence, config), "auto",
              "cut from the whole model (pp)"),
             ("tp=2", GPT(config), "auto", "the model was given built"),
             ("zero3=2", factory, False, "meta_init=False"),
             ("tp=2", functools.partial(nn.Linear, 4, 4), "auto",
              "Linear has no sharded initialisation")]
    for layout, model, meta_init, reason in cases:
        with torch.device("meta"):
            meta = model() if not isinstance(model, nn.Module) else None
        assert reason in whole_build_reason(Layout.parse(layout, 2), meta_init, model, meta)


def _start_lines(run_dir, layout, as_factory):
    import contextlib
    import io

    from conftest import trainer_kwargs

    from meshtrain import Trainer

    torch.set_num_threads(1)
    config = GPTConfig(vocab_size=32, seq_len=8, num_layers=2, num_heads=2, d_model=16)
    model = functools.partial(GPT, config) if as_factory else GPT(config)
    x = torch.randint(0, 32, (16, 8))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        Trainer(**trainer_kwargs(f"{run_dir}/{layout}{as_factory}", layout=layout,
                                 max_steps=1)).fit(
            model, torch.utils.data.TensorDataset(x, x), optimizer=lambda p: torch.optim.SGD(
                p, lr=0.1), loss_fn=lambda y, t: F.cross_entropy(y.flatten(0, 1), t.flatten()))
    return [line for line in out.getvalue().splitlines() if line.startswith("model: ")]


@pytest.mark.timeout(120)
def test_the_start_says_whether_each_rank_builds_the_whole_model(tmp_path):
    """What the README promises: a layout that splits the parameters says at start that each
    rank builds the whole model (with its size and why), or that it is built on meta."""
    lines = run_workers(_start_lines, 2, (tmp_path, "tp=2", True), timeout=100)[0]
    assert lines == ["model: built on the meta device; each rank allocates and initialises "
                     "only its part"], lines
    lines = run_workers(_start_lines, 2, (tmp_path, "tp=2", False), timeout=100)[0]
    assert len(lines) == 1 and "each rank builds the whole model first (" in lines[0] and \
        "parameters" in lines[0] and "the model was given built" in lines[0], lines
    assert run_workers(_start_lines, 2, (tmp_path, "dp=2", False), timeout=100)[0] == []


def test_a_from_pretrained_factory_is_told_the_init_from_route(tmp_path):
    import transformers

    from meshtrain.models.hf import tiny_llama
    from meshtrain.parallel.data.meta_init import whole_build_reason
    from meshtrain.parallel.layout import Layout

    tiny_llama().save_pretrained(tmp_path)
    factory = functools.partial(transformers.AutoModelForCausalLM.from_pretrained, tmp_path)
    reason = whole_build_reason(Layout.parse("zero3=2", 2), "auto", factory, None)
    assert "from_pretrained factory loads the whole checkpoint on every rank" in reason
    assert "init_from=" in reason
