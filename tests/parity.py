"""Parity harness: the same model, data and seed trained by one process on the full global batch
and by N processes under a layout; every rank must agree with the one process. Every strategy's
tests reuse it.

Per step it compares the logged loss and the global gradient norm before clipping (on every
rank); at the end every rank's parameters (each data-parallel replica, each pipeline stage). The
gradient norm is what sees a gradient-scale bug that AdamW or clipping would hide in the
parameters. :func:`assert_parity` trains both sides in float64 where the model allows (the
model ``.double()``, the floating data cast, fp32 precision): an exact layout then agrees to
~1e-12 and is judged to :data:`F64_TOL` relative, where a real bug stays 1e-3..1e-5 away, so
rounding neither hides nor fakes a difference; ``float64=False`` (and any mixed precision) keeps
the fp32 comparison to ``tol``. tests/test_parity_harness.py injects bugs and checks that
:func:`assert_parity` fails on each.
"""

from __future__ import annotations

import tempfile

import torch
from torch.utils.data import TensorDataset

from meshtrain import Trainer
from meshtrain.launch.spawn import run_workers
from meshtrain.parallel.whole_state import whole_state
from meshtrain.parity import F64_TOL, Curves
from meshtrain.parity.verdict import FLOOR_SLACK, Float64Samples

NUM_SAMPLES, IN_FEATURES, OUT_FEATURES = 96, 12, 3

# keys of a state that are not parameters (see train_state)
LOSSES, GRAD_NORMS = "__losses__", "__grad_norms__"


def regression_data(seed: int = 1234) -> TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(NUM_SAMPLES, IN_FEATURES, generator=gen)
    w = torch.randn(IN_FEATURES, OUT_FEATURES, generator=gen)
    y = torch.tanh(x @ w) + 0.1 * torch.randn(NUM_SAMPLES, OUT_FEATURES, generator=gen)
    return TensorDataset(x, y)


def mlp() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(IN_FEATURES, 32), torch.nn.GELU(),
        torch.nn.Linear(32, 32), torch.nn.GELU(),
        torch.nn.Linear(32, OUT_FEATURES),
    )


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)


def sgd(params):
    """Plain SGD: the update is proportional to the gradient, so any scale error shows in the
    parameters (AdamW is nearly invariant to a constant gradient factor)."""
    return torch.optim.SGD(params, lr=0.05)


def train_state(trainer_kwargs: dict, model_fn=mlp, data_fn=regression_data,
                optimizer_fn=adamw, loss_fn=torch.nn.functional.mse_loss, setup=None,
                whole_model: bool = True, float64: bool = False) -> dict:
    """Train in this process (or as one rank of a job) and return the parameters, under
    ``LOSSES`` the loss of every step (averaged over the ranks, as the Trainer logs it) and,
    with ``log_grad_norm=True``, under ``GRAD_NORMS`` every step's gradient norm before clipping.

    ``setup()`` runs first and may return extra callbacks (the harness self-tests inject faults
    with it). Under ``pp`` each rank holds its own stages: ``whole_model`` gathers them all.
    ``float64``: the model built then cast with ``.double()``, the data's floating tensors cast."""
    torch.set_num_threads(1)
    if float64:
        model_fn, data_fn = _cast_model(model_fn), _cast_data(data_fn)
    curve = Curves()
    extra = list(setup() or ()) if setup is not None else []
    with tempfile.TemporaryDirectory() as run_dir:
        kwargs = dict(loggers=(), progress_bar=False, save_final_checkpoint=False,
                      report=False, run_dir=run_dir, seed=0, log_every_n_steps=1)
        kwargs.update(trainer_kwargs)
        kwargs["callbacks"] = [curve, *extra, *kwargs.get("callbacks", ())]
        trainer = Trainer(**kwargs)
        model = trainer.fit(model_fn, data_fn(), optimizer=optimizer_fn, loss_fn=loss_fn)
        # under pp each rank holds its own stages: whole_model gathers them all
        state = whole_state(model, trainer.layout.degree("pp") if whole_model else 1)
        state[LOSSES] = torch.tensor(curve.losses, dtype=torch.float64)
        if trainer.log_grad_norm:
            state[GRAD_NORMS] = torch.tensor(curve.grad_norms, dtype=torch.float64)
        return state


def _cast_model(model_fn):
    def build():
        return model_fn().double()
    return build


def _cast_data(data_fn):
    def build():
        return Float64Samples(data_fn())
    return build


def params_of(state: dict) -> dict:
    """The parameters (and buffers) of a state from :func:`train_state`."""
    return {k: v for k, v in state.items() if not k.startswith("__")}


def run_ranks(trainer_kwargs: dict, num_procs: int, timeout: float = 120, **fns) -> list[dict]:
    """Every rank's state: what that rank holds (its pipeline stages only, under pp)."""
    if num_procs == 1:
        return [train_state(trainer_kwargs, **fns)]
    return run_workers(_train_rank, num_procs, (trainer_kwargs, fns), timeout=timeout)


def run_layout(trainer_kwargs: dict, num_procs: int, timeout: float = 120, **fns) -> dict:
    """One state for the whole model: rank 0's, with the stages other ranks hold added."""
    merged: dict = {}
    for state in run_ranks(trainer_kwargs, num_procs, timeout, **fns):
        merged.update({k: v for k, v in state.items() if k not in merged})
    return merged


def _train_rank(trainer_kwargs, fns):
    return train_state(trainer_kwargs, **{"whole_model": False, **fns})


def max_param_diff(a: dict, b: dict) -> float:
    names = list(params_of(a))
    assert sorted(names) == sorted(params_of(b))
    return max((a[k].double() - b[k].double()).abs().max().item() for k in names)


def compare_ranks(reference: dict, ranks: list[dict], *, tol: float = 1e-5,
                  label: str = "layout", relative: bool = False) -> float:
    """Check every rank's state against the one-process ``reference``: its parameters, its
    per-step losses and (when recorded) gradient norms; together the ranks must hold every
    parameter. Returns the largest parameter difference. ``relative``: each parameter's, loss's
    and norm's difference is judged relative to its size (float64: ``tol`` = F64_TOL)."""
    names = set(params_of(reference))
    held = set().union(*(params_of(state) for state in ranks))
    assert held == names, (f"{label}: the ranks hold {sorted(held - names)} beyond and miss "
                           f"{sorted(names - held)} of the reference's parameters")
    for rank, state in enumerate(ranks):  # per step first: it names where the runs part
        first = None  # (step, what, got, want) of the earliest difference
        for key, what, rel in ((GRAD_NORMS, "gradient norm", True), (LOSSES, "loss", False)):
            if key not in reference:
                continue
            want, got = reference[key], state[key]
            assert len(got) == len(want), f"{label}: rank {rank} ran {len(got)} steps, not {len(want)}"
            # gradient norms relative to their size; losses as they are (float64: both relative)
            if relative:
                limit = tol * want.abs().clamp(min=1e-300)
            else:
                limit = max(tol, 1e-5) * (want.abs().clamp(min=1) if rel else 1)
            bad = ((got - want).abs() > limit) | (got.isnan() != want.isnan())
            if bad.any() and (first is None or int(bad.nonzero()[0]) < first[0]):
                i = int(bad.nonzero()[0])
                first = (i, what, float(got[i]), float(want[i]))
        if first is not None:
            i, what, got, want = first
            raise AssertionError(f"{label}: rank {rank}'s {what} at step {i + 1} is {got:.12g}, "
                                 f"one process has {want:.12g} (ratio {got / want:.4g}, "
                                 f"relative difference {abs(got - want) / abs(want):.1e})")
    worst = 0.0
    for rank, state in enumerate(ranks):
        for name in params_of(state):
            want = reference[name].double()
            diff = (state[name].double() - want).abs().max().item() if want.numel() else 0.0
            if relative:  # relative to the tensor's size
                diff /= max(want.abs().max().item(), 1e-300) if want.numel() else 1.0
            assert diff <= tol, (f"{label}: rank {rank}'s {name} differs from one process by "
                                 f"{diff:.3e}{' (relative)' if relative else ''} "
                                 f"(tolerance {tol:.0e})")
            worst = max(worst, diff)
    return worst


def assert_parity(layout: str, num_procs: int, *, tol: float = 1e-5, steps: int = 20,
                  global_batch_size: int = 16, micro_batch_size: int | None = None,
                  fns: dict | None = None, setup=None, float64: bool | None = None, **kwargs):
    """Compare ``layout`` on ``num_procs`` ranks against one process; return the largest
    parameter difference (relative in float64).

    ``float64`` (default: unless a mixed precision is asked for): both sides train in float64
    and every tensor, loss and norm must agree to F64_TOL relative; else in fp32 to ``tol``.
    ``fns`` may replace the model, data, optimizer or loss (see ``train_state``); ``kwargs`` go
    to the Trainer of both runs (the reference runs in fp32 unless ``reference_kwargs`` says).
    ``setup`` runs on every rank of the layout's run only (for injecting faults).
    """
    fns = dict(fns or {})
    reference_kwargs = kwargs.pop("reference_kwargs", {})
    parallel_kwargs = kwargs.pop("parallel_kwargs", {})  # e.g. pipeline options
    if float64 is None:
        float64 = kwargs.get("precision", "fp32") == "fp32" and \
            reference_kwargs.get("precision", "fp32") == "fp32"
    fns["float64"] = float64
    common = dict(max_steps=steps, global_batch_size=global_batch_size, log_grad_norm=True,
                  **kwargs)
    reference = train_state(dict(common, **reference_kwargs), **fns)
    ranks = run_ranks(dict(common, layout=layout, micro_batch_size=micro_batch_size,
                           **parallel_kwargs), num_procs, setup=setup, **fns)
    moved = max_param_diff(reference, train_state(dict(common, max_steps=1), **fns))
    assert moved > 2 * tol, "training barely moved the parameters: the test would prove nothing"
    assert len(reference[LOSSES]) == steps
    label = f"{layout} on {num_procs} ranks{' in float64' if float64 else ''}"
    if not float64:
        return compare_ranks(reference, ranks, tol=tol, label=label)
    try:
        return compare_ranks(reference, ranks, tol=F64_TOL, label=label, relative=True)
    except AssertionError:  # a model that computes in float32 on purpose: judged by its floor
        floor = model_floor(reference, dict(common, **reference_kwargs), fns, global_batch_size)
        if floor is None:
            raise
        return compare_ranks(reference, ranks, tol=max(F64_TOL, FLOOR_SLACK * floor),
                             label=f"{label} (the model's own float64 floor {floor:.1e})",
                             relative=True)


def model_floor(reference: dict, kwargs: dict, fns: dict, global_batch_size: int):
    """The model's own float64 floor, as `meshtrain parity` measures it (verdict.model_floor):
    how far one process moves with half the micro-batch; None when it cannot tell (an odd
    batch) or when that changes the training itself (batch statistics)."""
    from meshtrain.parity.verdict import model_floor as floor_of

    if global_batch_size % 2:
        return None
    split = train_state(dict(kwargs, micro_batch_size=global_batch_size // 2), **fns)

    def run(state):
        return {"params": params_of(state), "losses": state[LOSSES],
                "grad_norms": state.get(GRAD_NORMS, torch.zeros(len(state[LOSSES])))}
    return floor_of(run(reference), run(split))


# A tiny GPT on random tokens: blocks in model.layers and an init_weights() for meta-device builds.
VOCAB, SEQ = 16, 8


def tiny_gpt(num_layers: int = 2):
    from meshtrain.models.gpt import GPT, GPTConfig

    # no biases: attention's key bias has an exactly zero true gradient (softmax ignores a shift
    # shared by all keys), and AdamW turns the rounding noise on it into lr-sized steps
    return GPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, num_layers=num_layers, num_heads=2,
                         d_model=16, bias=False))


def tiny_gpt_4_layers():
    return tiny_gpt(num_layers=4)


def token_data(seed: int = 99) -> TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (NUM_SAMPLES, SEQ + 1), generator=gen)
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


def lm_loss(logits, targets):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def adamw_gpt(params):
    # lr 1e-3: at 1e-2, Adam's update of elements whose gradient is near eps (1e-8) flips with
    # the summation order of the reduction, and the layouts differ by up to 2e-5 after 5 steps
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)


GPT_FNS = dict(model_fn=tiny_gpt, data_fn=token_data, loss_fn=lm_loss, optimizer_fn=adamw_gpt)
GPT4_FNS = dict(model_fn=tiny_gpt_4_layers, data_fn=token_data, loss_fn=lm_loss,
                optimizer_fn=adamw_gpt)


# The same tiny GPT on sequences of 12 tokens (not a power of two): context parallel cuts them
# into 2 x cp chunks (cp=2: four chunks of 3 tokens).
SEQ_12 = 12


def tiny_gpt_seq12():
    from meshtrain.models.gpt import GPT, GPTConfig

    return GPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ_12, num_layers=2, num_heads=2,
                         d_model=16, bias=False))


def token_data_seq12(seed: int = 99) -> TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (NUM_SAMPLES, SEQ_12 + 1), generator=gen)
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


GPT12_FNS = dict(model_fn=tiny_gpt_seq12, data_fn=token_data_seq12, loss_fn=lm_loss,
                 optimizer_fn=adamw_gpt)


def regression_job() -> dict:
    """The regression MLP as a `meshtrain parity` entry point (``parity:regression_job``)."""
    return dict(model=mlp, train_data=regression_data(), optimizer=adamw,
                loss_fn=torch.nn.functional.mse_loss,
                settings=dict(global_batch_size=16, seed=0))


# Batch-coupled training (issue 13): a BatchNorm MLP, and tokens with ignored (-100) targets.
def bn_mlp() -> torch.nn.Module:
    # no bias before the norm: BatchNorm removes any shift, so its true gradient is exactly 0
    # and AdamW would turn the rounding noise on it into lr-sized steps
    return torch.nn.Sequential(
        torch.nn.Linear(IN_FEATURES, 16, bias=False), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
        torch.nn.Linear(16, OUT_FEATURES))


def padded_tokens(seed: int = 7) -> TensorDataset:
    """Random 12-token sequences; sample i keeps its first k_i targets (1 to 12), the rest are
    -100 (ignored), so micro-batches hold different numbers of tokens."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (NUM_SAMPLES, SEQ_12 + 1), generator=gen)
    inputs, targets = tokens[:, :-1].clone(), tokens[:, 1:].clone()
    keep = torch.randint(1, SEQ_12 + 1, (NUM_SAMPLES,), generator=gen)
    targets[torch.arange(SEQ_12) >= keep[:, None]] = -100
    return TensorDataset(inputs, targets)


def plain_mean_loss(logits, targets):
    """The token mean of each micro-batch (what a global-mean loss replaces)."""
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(),
                                             ignore_index=-100)


def batchnorm_job() -> dict:
    """``parity:batchnorm_job``: the BatchNorm MLP on the regression data."""
    return dict(model=bn_mlp, train_data=regression_data(), optimizer=adamw,
                loss_fn=torch.nn.functional.mse_loss, settings=dict(global_batch_size=16, seed=0))


def padded_lm_job(plain: bool = False) -> dict:
    """``parity:padded_lm_job``: the 12-token GPT on padded targets, token-mean loss."""
    from meshtrain.losses import cross_entropy

    return dict(model=tiny_gpt_seq12, train_data=padded_tokens(), optimizer=adamw_gpt,
                loss_fn=plain_mean_loss if plain else cross_entropy(ignore_index=-100),
                settings=dict(global_batch_size=16, seed=0))


def padded_lm_plain_job() -> dict:
    """``parity:padded_lm_plain_job``: the same with a per-micro-batch mean loss."""
    return padded_lm_job(plain=True)
