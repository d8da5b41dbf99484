"""Parity harness: the same model, data and seed trained by one process on the full global batch
and by N processes under a layout; the parameters must agree. Every strategy's tests reuse it."""

from __future__ import annotations

import tempfile

import torch
from torch.utils.data import TensorDataset

from meshtrain import Callback, Trainer
from meshtrain.launch.spawn import run_workers

NUM_SAMPLES, IN_FEATURES, OUT_FEATURES = 96, 12, 3


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


def train_state(trainer_kwargs: dict, model_fn=mlp, data_fn=regression_data,
                optimizer_fn=adamw, loss_fn=torch.nn.functional.mse_loss) -> dict:
    """Train in this process (or as one rank of a job) and return the parameters, and under
    ``LOSSES`` the loss of every step (averaged over the ranks, as the Trainer logs it)."""
    torch.set_num_threads(1)
    curve = _LossCurve()
    with tempfile.TemporaryDirectory() as run_dir:
        kwargs = dict(loggers=(), progress_bar=False, save_final_checkpoint=False,
                      run_dir=run_dir, seed=0, log_every_n_steps=1, callbacks=[curve])
        kwargs.update(trainer_kwargs)
        trainer = Trainer(**kwargs)
        model = trainer.fit(model_fn, data_fn(), optimizer=optimizer_fn, loss_fn=loss_fn)
        state = {k: _full(v).detach().cpu().clone() for k, v in model.state_dict().items()}
        if trainer.layout.degree("pp") > 1:  # each rank holds its stages: put them together
            import torch.distributed as dist

            parts = [None] * dist.get_world_size()
            dist.all_gather_object(parts, state)
            state = {k: v for part in parts for k, v in part.items()}
        state[LOSSES] = torch.tensor(curve.losses, dtype=torch.float64)
        return state


LOSSES = "__losses__"


class _LossCurve(Callback):
    def __init__(self):
        self.losses = []

    def on_train_step_end(self, trainer, metrics):
        if "train/loss" in metrics:
            self.losses.append(metrics["train/loss"])


def _full(tensor):
    """A sharded (DTensor) parameter gathered whole; a plain tensor as it is."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def run_layout(trainer_kwargs: dict, num_procs: int, timeout: float = 120, **fns) -> dict:
    if num_procs == 1:
        return train_state(trainer_kwargs, **fns)
    return run_workers(_train_rank, num_procs, (trainer_kwargs, fns), timeout=timeout)[0]


def _train_rank(trainer_kwargs, fns):
    return train_state(trainer_kwargs, **fns)


def max_param_diff(a: dict, b: dict) -> float:
    names = [k for k in a if k != LOSSES]
    assert sorted(names) == sorted(k for k in b if k != LOSSES)
    return max((a[k].double() - b[k].double()).abs().max().item() for k in names)


def assert_parity(layout: str, num_procs: int, *, tol: float = 1e-5, steps: int = 20,
                  global_batch_size: int = 16, micro_batch_size: int | None = None,
                  fns: dict | None = None, **kwargs):
    """Compare ``layout`` on ``num_procs`` ranks against one process; return the difference.

    ``fns`` may replace the model, data, optimizer or loss (see ``train_state``); ``kwargs`` go
    to the Trainer of both runs (the reference runs in fp32 unless ``reference_kwargs`` says).
    """
    fns = fns or {}
    reference_kwargs = kwargs.pop("reference_kwargs", {})
    parallel_kwargs = kwargs.pop("parallel_kwargs", {})  # e.g. pipeline options
    common = dict(max_steps=steps, global_batch_size=global_batch_size, **kwargs)
    reference = run_layout(dict(common, **reference_kwargs), 1, **fns)
    parallel = run_layout(dict(common, layout=layout, micro_batch_size=micro_batch_size,
                               **parallel_kwargs), num_procs, **fns)
    diff = max_param_diff(reference, parallel)
    moved = max_param_diff(reference, run_layout(dict(common, max_steps=1), 1, **fns))
    assert moved > 2 * tol, "training barely moved the parameters: the test would prove nothing"
    assert diff <= tol, f"{layout} on {num_procs} ranks differs from one process by {diff:.3e}"
    curves = reference[LOSSES], parallel[LOSSES]
    assert len(curves[0]) == len(curves[1]) == steps
    curve_diff = (curves[0] - curves[1]).abs().max().item()
    assert curve_diff <= max(tol, 1e-5), f"{layout}: loss curves differ by {curve_diff:.3e}"
    return diff


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
