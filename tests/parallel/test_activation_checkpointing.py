"""Activation checkpointing ("full", "selective") leaves gradients and parameter names unchanged,
keeps what it should, and composes with FSDP2 and DDP."""

import pytest
import torch
import torch.nn.functional as F
from conftest import end_together, join_gloo, max_diff
from torch.nn.parallel import DistributedDataParallel
from torch.utils._python_dispatch import TorchDispatchMode

from meshtrain.errors import ConfigError
from meshtrain.launch.spawn import run_workers
from meshtrain.models.gpt import GPT, GPTConfig
from meshtrain.parallel.activation_checkpointing import apply_activation_checkpointing

MODES = ("full", "selective")
STEPS, BATCH = 3, 4

pytestmark = pytest.mark.usefixtures("one_thread_per_module")


def gpt(dropout: float = 0.0) -> GPT:
    config = GPTConfig(vocab_size=16, seq_len=8, num_layers=2, num_heads=2, d_model=16,
                       dropout=dropout)
    return GPT(config, seed=0)


def tokens(step: int = 0) -> torch.Tensor:
    return torch.randint(0, 16, (BATCH, 9), generator=torch.Generator().manual_seed(step))


def loss_of(model, batch: torch.Tensor) -> torch.Tensor:
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


def grads(model) -> dict:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def checkpointed(mode: str, dropout: float = 0.0) -> GPT:
    model = gpt(dropout)
    apply_activation_checkpointing(model, mode, list(model.layers))
    return model


# -- one process -----------------------------------------------------------------------------------
@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("mode", MODES)
def test_gradients_match_the_plain_model(mode, dropout):
    results = []
    for model in (gpt(dropout), checkpointed(mode, dropout)):
        torch.manual_seed(7)  # the same dropout masks; recomputation must replay them
        loss_of(model, tokens()).backward()
        results.append(grads(model))
    assert max_diff(*results) <= 1e-6
    assert max(g.abs().max().item() for g in results[0].values()) > 1e-3


@pytest.mark.parametrize("mode", MODES)
def test_parameter_names_are_unchanged(mode):
    plain, model = gpt(), checkpointed(mode)
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in plain.named_parameters()]
    assert list(model.state_dict()) == list(plain.state_dict())


class CountOps(TorchDispatchMode):
    """Counts the aten ops that actually run (a cached selective-checkpoint output does not)."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def ops_in_backward(model) -> list[str]:
    loss = loss_of(model, tokens())
    with CountOps() as counter:
        loss.backward()
    return counter.names


def test_selective_keeps_matmul_and_attention_outputs_and_recomputes_the_rest():
    recomputed = {
        mode: ops_in_backward(model)
        for mode, model in (("plain", gpt()), ("full", checkpointed("full")),
                            ("selective", checkpointed("selective")))
    }
    forward_ops = ("addmm", "_scaled_dot_product_flash_attention_for_cpu", "gelu",
                   "native_layer_norm")
    counts = {m: {op: names.count(op) for op in forward_ops} for m, names in recomputed.items()}
    assert set(counts["plain"].values()) == {0}
    # Each block's 6 projections but the last (fc_out: its output is not needed for backward,
    # and non-reentrant recomputation stops early), 2 attentions, 2 GELUs, 4 layer norms.
    assert counts["full"] == dict(zip(forward_ops, (10, 2, 2, 4)))
    assert counts["selective"] == dict(zip(forward_ops, (0, 0, 2, 4)))


def test_none_leaves_the_model_alone():
    model = gpt()
    apply_activation_checkpointing(model, None, [])
    assert all(not m._forward_pre_hooks for m in model.modules())


def test_errors():
    model = gpt()
    with pytest.raises(ConfigError, match="unknown activation checkpointing mode 'fulll'"):
        apply_activation_checkpointing(model, "fulll", list(model.layers))
    with pytest.raises(ConfigError, match="none were found — pass blocks="):
        apply_activation_checkpointing(model, "full", [])
    with pytest.raises(ConfigError, match="not a submodule of the model"):
        apply_activation_checkpointing(model, "full", [gpt().layers[0]])
    apply_activation_checkpointing(model, "selective", list(model.layers))
    with pytest.raises(ConfigError, match="already checkpointed"):
        apply_activation_checkpointing(model, "full", list(model.layers))


# -- with FSDP2 and DDP on 2 ranks -----------------------------------------------------------------
def train(model, step_model, full_tensor=lambda t: t, rank=0, world=1):
    """STEPS SGD steps on this rank's slice; returns (parameters, last step's gradients)."""
    # SGD: Adam would amplify float rounding in tiny gradients and blur the comparison.
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    part = BATCH // world
    for step in range(STEPS):
        loss_of(step_model, tokens(step)[rank * part:(rank + 1) * part]).backward()
        if step == STEPS - 1:
            last = {n: full_tensor(p.grad).clone() for n, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad()
    return {n: full_tensor(p.detach()).clone() for n, p in model.named_parameters()}, last


def _parallel_rank():
    from torch.distributed.fsdp import fully_shard

    rank, world = join_gloo()
    results = {}
    for mode in MODES:
        model = checkpointed(mode)
        for block in model.layers:
            fully_shard(block)
        fully_shard(model)
        results["fsdp2", mode] = train(model, model, lambda t: t.full_tensor(), rank, world)
        results["fsdp2", mode, "addmm"] = ops_in_backward(model).count("addmm")
        model = checkpointed(mode)
        ddp = DistributedDataParallel(model, gradient_as_bucket_view=True)
        results["ddp", mode] = train(model, ddp, rank=rank, world=world)
        results["ddp", mode, "addmm"] = ops_in_backward(ddp).count("addmm")
    with pytest.raises(ConfigError, match="before FSDP2"):
        model = gpt()
        fully_shard(model.layers[0])
        apply_activation_checkpointing(model, "full", list(model.layers))
    return end_together(results)  # the group is destroyed at exit, after DDP and FSDP are freed


@pytest.fixture(scope="module")
def parallel_runs():
    return run_workers(_parallel_rank, 2, timeout=110)


@pytest.fixture(scope="module")
def one_process():
    model = gpt()
    return train(model, model)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("wrapper", ["fsdp2", "ddp"])
@pytest.mark.parametrize("mode", MODES)
def test_composes_with_data_parallelism(parallel_runs, one_process, wrapper, mode):
    ref_params, ref_grads = one_process
    assert max_diff(ref_params, {n: p for n, p in gpt().named_parameters()}) > 1e-3
    for run in parallel_runs:
        params, last_grads = run[wrapper, mode]
        assert max_diff(last_grads, ref_grads) <= 1e-6
        assert max_diff(params, ref_params) <= 1e-6
        # still checkpointing under the wrapper: projections recomputed in backward, or kept
        assert run[wrapper, mode, "addmm"] == (10 if mode == "full" else 0)
