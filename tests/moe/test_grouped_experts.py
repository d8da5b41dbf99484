"""meshtrain's MoE experts as one grouped GEMM over token offsets (meshtrain/moe/grouped.py):
equal to the per-expert loop they replace, no host sync in a step (none from the MoE layers in
one process, one per layer under ep: the all-to-all's split sizes), and the whole layer in one
compiled graph; float64 takes the masked fallback, said once."""

import logging
import traceback
import unittest.mock
from pathlib import Path

import pytest
import torch
from parity import SEQ, adamw_gpt, lm_loss, token_data
from test_moe_gpt import moe_gpt

from meshtrain.moe import grouped

torch.set_num_threads(1)

MOE_FILES = tuple(str(Path(grouped.__file__).parent / name) for name in ("layer.py", "grouped.py")
                  ) + (str(Path(grouped.__file__).parents[1] / "parallel/expert/dispatch.py"),)
#: what hands a device value to the host (on a GPU: a sync)
SYNCS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")


def skewed_moe_gpt():
    """Uneven counts, and an expert without any token (its bias keeps it from being picked)."""
    model = moe_gpt(num_experts=4, experts_per_token=2, expert_hidden_dim=24)
    for layer in model.layers:
        layer.mlp.router.expert_bias.copy_(torch.tensor([0.0, 0.05, -100.0, 0.0]))
    return model


def one_step(model, batch) -> dict:
    """The loss and every parameter's gradient of one forward and backward."""
    model.zero_grad()
    loss = lm_loss(model(batch[0]), batch[1])
    loss.backward()
    return {"loss": loss.detach(), **{n: p.grad.clone() for n, p in model.named_parameters()}}


def looped(tokens, w_in, w_out, counts, activation):
    """The experts as meshtrain ran them before: one matmul pair per expert on its slice."""
    return grouped.looped_experts(tokens, w_in, w_out, counts.tolist(), activation)


def test_grouped_gemm_equals_the_per_expert_loop_forward_and_backward():
    """fp32: the grouped GEMM against the loop on a step of the MoE GPT (an expert with no
    token, uneven counts): loss and every gradient within 1e-6 relative."""
    torch.manual_seed(0)
    model = skewed_moe_gpt()
    batch = token_data()[:16]
    got = one_step(model, batch)
    with unittest.mock.patch.object(grouped, "grouped_experts", looped):
        want = one_step(model, batch)
    with unittest.mock.patch.object(grouped, "grouped_experts",
                                    side_effect=AssertionError("not the grouped GEMM")):
        with pytest.raises(AssertionError, match="not the grouped GEMM"):
            one_step(model, batch)  # (the path measured above is the grouped one)
    w_in = got["layers.0.mlp.experts.w_in"]
    assert w_in[2].abs().max() == 0 < w_in[3].abs().max()  # (expert 2 got no token)
    assert got.keys() == want.keys()
    for name, a in got.items():
        b = want[name]
        assert ((a - b).abs().max() / b.abs().max()) < 1e-6, name


def test_the_grouped_experts_alone_take_a_gradient_of_any_layout():
    """``sum()``'s gradient is a broadcast (not contiguous), which torch._grouped_mm's CPU
    backward refuses ("Invalid strides/sizes"): the experts hand it a contiguous one."""
    from meshtrain.moe.layer import GroupedExperts

    torch.manual_seed(0)
    experts = GroupedExperts(4, 16, 32)
    for w in (experts.w_in, experts.w_out):
        torch.nn.init.normal_(w)
    tokens = torch.randn(10, 16, requires_grad=True)
    counts = torch.tensor([3, 0, 4, 3])
    grads = []
    for run in (experts, lambda t, c: looped(t, experts.w_in, experts.w_out, c,
                                              torch.nn.functional.gelu)):
        tokens.grad = experts.w_in.grad = experts.w_out.grad = None
        run(tokens, counts).sum().backward()
        grads.append([tokens.grad, experts.w_in.grad, experts.w_out.grad])
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert grads[0][1][1].abs().max() == 0 < grads[0][1][0].abs().max()  # (expert 1: none)


def test_float64_runs_each_expert_masked_and_says_so_once():
    """No float64 kernel: the masked fallback, equal to the loop (1e-12), said once."""
    torch.manual_seed(0)
    model = skewed_moe_gpt().double()
    batch = token_data()[:16]
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("meshtrain")
    logger.addHandler(handler)
    grouped._SAID.clear()
    try:
        got = one_step(model, batch)
        one_step(model, batch)
    finally:
        logger.removeHandler(handler)
    said = [r.getMessage() for r in records if "MoE experts" in r.getMessage()]
    assert said == ["MoE experts: torch.float64 has no grouped GEMM kernel (torch._grouped_mm "
                    "computes float32, bfloat16 and float16); each expert runs in turn over "
                    "the routed tokens (masked: E times the grouped GEMM's FLOPs)"]
    with unittest.mock.patch.object(grouped, "masked_experts", looped):
        want = one_step(model, batch)
    for name, a in got.items():
        b = want[name]
        assert ((a - b).abs().max() / b.abs().max()) < 1e-12, name


@pytest.mark.timeout(300)
def test_the_moe_layer_compiles_whole():
    """torch.compile(fullgraph=True) (Inductor, CPU) over router, permutation, the grouped
    experts and the combine: forward and backward equal eager's."""
    torch.manual_seed(0)
    moe = skewed_moe_gpt().layers[0].mlp
    x = torch.randn(2, SEQ, 16, requires_grad=True)
    grad = torch.randn(2, SEQ, 16)

    def step(layer):
        x.grad = None
        moe.zero_grad()
        out = layer(x)
        (out * grad).sum().backward()
        return [out.detach(), x.grad] + [p.grad.clone() for p in moe.parameters()]

    want = step(moe)
    got = step(torch.compile(moe, fullgraph=True))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# ---- host syncs in a training step --------------------------------------------------------------
def syncs_in_a_step(layout: str | None, float64: bool = False) -> list[str]:
    """One training step of the MoE GPT (fp32 unless ``float64``): the calls that hand a
    tensor's values to the host (:data:`SYNCS`) with a frame of the MoE layers' files in their
    stack, each as ``file:line`` of its innermost such frame. Counted from the step's start
    to its end (forward, backward, optimizer step), not during set-up."""
    import tempfile

    from meshtrain import Callback, Trainer

    torch.set_num_threads(1)
    found, on = [], [False]

    def counting(name, original):
        def wrapper(self, *args, **kwargs):
            if on[0]:
                frames = [f for f in traceback.extract_stack()[:-1] if f.filename in MOE_FILES]
                if frames:
                    found.append(f"{Path(frames[-1].filename).name}:{frames[-1].lineno} {name}")
            return original(self, *args, **kwargs)
        return wrapper

    class Window(Callback):
        def on_train_step_start(self, trainer):
            on[0] = True

        def on_train_step_end(self, trainer, metrics):
            on[0] = False

    patches = [unittest.mock.patch.object(torch.Tensor, name,
                                          counting(name, getattr(torch.Tensor, name)))
               for name in SYNCS]
    for patch in patches:
        patch.start()
    try:
        with tempfile.TemporaryDirectory() as run_dir:
            trainer = Trainer(layout=layout, max_steps=1, global_batch_size=16, loggers=(),
                              progress_bar=False, report=False, save_final_checkpoint=False,
                              model_summary=False, run_dir=run_dir, callbacks=[Window()])
            build = (lambda: moe_gpt().double()) if float64 else moe_gpt
            trainer.fit(build, token_data(), optimizer=adamw_gpt, loss_fn=lm_loss)
    finally:
        for patch in patches:
            patch.stop()
    return found


def test_no_host_sync_from_the_moe_layers_in_one_process():
    for float64 in (False, True):
        assert syncs_in_a_step(None, float64) == [], float64


@pytest.mark.timeout(300)
def test_one_host_sync_per_moe_layer_under_expert_parallel():
    """Under ep=2 each layer's forward reads the all-to-all's split sizes once (2 layers:
    2 per rank); the backward reuses them."""
    from meshtrain.launch.spawn import run_workers

    for found in run_workers(syncs_in_a_step, 2, ("ep=2",), timeout=200):
        assert len(found) == 2 and all("dispatch.py" in f and "tolist" in f for f in found), \
            found
        assert len(set(found)) == 1, found  # (the same line: AllToAllExperts.exchange)


# ---- a Hugging Face MoE under ep: its own grouped experts, eager where they have no kernel --------
def qwen3_moe_grouped():
    """A tiny Qwen3-MoE as transformers builds it by default: experts_implementation left to
    transformers ("grouped_mm")."""
    from meshtrain.models.hf import tiny_causal_lm

    return tiny_causal_lm("Qwen3Moe", vocab_size=32, hidden_size=16, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=2, head_dim=8,
                          max_position_embeddings=16, moe_intermediate_size=8, num_experts=4,
                          num_experts_per_tok=2)


def _hf_ep_rank(float64: bool) -> dict:
    """One rank of 3 steps under ep=2, with torch's grouped GEMM calls counted."""
    from parity import train_state

    from meshtrain.models.hf import random_token_data

    calls = [0]
    original = torch.nn.functional.grouped_mm

    def counted(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    with unittest.mock.patch.object(torch.nn.functional, "grouped_mm", counted):
        state = train_state(dict(max_steps=3, global_batch_size=8, shuffle=False, layout="ep=2"),
                            model_fn=qwen3_moe_grouped, data_fn=random_token_data,
                            loss_fn=None, optimizer_fn=adamw_gpt, float64=float64,
                            whole_model=False)
    state["__grouped_mm_calls"] = calls[0]
    return state


def _plain_transformers(float64: bool) -> dict:
    """transformers alone, 3 steps of 8 samples (float64: its eager experts)."""
    from meshtrain.models.hf import random_token_data

    model = qwen3_moe_grouped()
    if float64:
        model = model.double()
        model.set_experts_implementation("eager")
    optimizer = adamw_gpt(model.parameters())
    data = random_token_data()
    for step in range(3):
        rows = range(step * 8, (step + 1) * 8)
        batch = {k: torch.stack([data[i][k] for i in rows]) for k in ("input_ids", "labels")}
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.timeout(300)
def test_a_hugging_face_moe_under_ep_runs_its_grouped_experts_eager_only_in_float64():
    """Under ep=2 each rank's local experts run the model's own experts forward: transformers'
    grouped_mm (its default) in fp32, equal to plain transformers' grouped_mm to 1e-5; in
    float64, which torch's grouped GEMM has no kernel for, its eager loop (chosen by
    meshtrain; the model's config still says grouped_mm), equal to plain transformers' eager
    float64 run to 1e-9."""
    from meshtrain.launch.spawn import run_workers
    from parity import F64_TOL, compare_ranks

    for float64, tol in ((False, 1e-5), (True, F64_TOL)):
        ranks = run_workers(_hf_ep_rank, 2, (float64,), timeout=200)
        calls = [rank.pop("__grouped_mm_calls") for rank in ranks]
        assert all(c == 0 for c in calls) if float64 else all(c > 0 for c in calls), calls
        reference = _plain_transformers(float64)
        compare_ranks(reference, [{k: v for k, v in r.items() if not k.startswith("__")}
                                  for r in ranks], tol=tol, relative=True,
                      label=f"Qwen3Moe ep=2{' float64' if float64 else ''}")
