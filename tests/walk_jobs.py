"""The jobs of the setting walk (tests/test_every_setting.py, tests/settings_walk.py): tiny
models with their data and loss, the values that are objects (made where the run is), and a
checkpoint and a Hugging Face folder made once for ``resume`` and ``init_from``."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import Dataset, TensorDataset

from meshtrain import Callback, Trainer

VOCAB, SEQ, SAMPLES = 16, 8, 32  # 32 samples: 2 steps of 16 per epoch


# -- the jobs: model factory, data, loss, optimizer ----------------------------------------------
def _tokens(seed: int, zero_row: int | None = None) -> TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (SAMPLES, SEQ + 1), generator=gen)
    if zero_row is not None:  # the nan job's marked sample: every target 0
        tokens[zero_row, 1:] = 0
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


def lm_loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def nan_on_marked(logits, targets):
    """lm_loss, NaN for a micro-batch holding the marked sample."""
    loss = lm_loss(logits, targets)
    return loss * float("nan") if bool((targets == 0).all(dim=1).any()) else loss


class SlowOnRank1(Dataset):
    """Tokens whose every sample takes 20 ms to read on rank 1 (a straggler: 160 ms a step,
    beyond a busy CI machine's jitter; at 5 ms a sample CI once saw no straggler)."""

    def __init__(self):
        self.base = _tokens(99)

    def __len__(self):
        return len(self.base)

    def __getitem__(self, index):
        if dist.is_initialized() and dist.get_rank() == 1:
            time.sleep(0.02)
        return self.base[index]


def gpt(num_layers: int = 2):
    from meshtrain.models.gpt import GPT, GPTConfig

    return GPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, num_layers=num_layers, num_heads=2,
                         d_model=16, bias=False))


class ScaledMLP(torch.nn.Module):
    """fc1 -> a scalar gain -> fc2: under a plan that splits fc1 by columns and fc2 by rows the
    gain sees a different half of the features on each tp rank (a wrong plan: its gradient
    differs between the ranks)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(12, 16), torch.nn.Linear(16, 3)
        self.gain = torch.nn.Parameter(torch.ones(()))

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)) * self.gain)


def _regression(seed: int = 1234) -> TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(SAMPLES, 12, generator=gen)
    return TensorDataset(x, torch.tanh(x[:, :3]))


def _bn_mlp():
    return torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.BatchNorm1d(16),
                               torch.nn.ReLU(), torch.nn.Linear(16, 3))


def job(name: str) -> dict:
    """model (a factory), train and validation data, loss of the job ``name``."""
    lm = dict(model=gpt, train=_tokens(99), val=_tokens(5), loss=lm_loss)
    return {
        "lm": lm,
        "lm4": {**lm, "model": lambda: gpt(4)},
        "nan": {**lm, "train": _tokens(99, zero_row=5), "loss": nan_on_marked},
        "slow": {**lm, "train": SlowOnRank1()},
        "bn": dict(model=_bn_mlp, train=_regression(), val=_regression(7), loss=F.mse_loss),
        "scaled": dict(model=ScaledMLP, train=_regression(), val=_regression(7), loss=F.mse_loss),
    }[name]


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2)


# -- values that are objects, made where the run is ----------------------------------------------
class StopAfterOneStep(Callback):
    def on_train_step_end(self, trainer, metrics):
        trainer.should_stop = True


def _scaled_plan():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}


def _mlp_only_plan():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {f"layers.{i}.mlp.{name}": style for i in range(2)
            for name, style in (("fc_in", ColwiseParallel()), ("fc_out", RowwiseParallel()))}


MAKERS = {
    "stop_after_one_step": lambda ctx: [StopAfterOneStep()],
    "first_block": lambda ctx: (lambda model: [model.layers[0]]),
    "scaled_plan": lambda ctx: _scaled_plan(),
    "mlp_only_plan": lambda ctx: _mlp_only_plan(),
    "checkpoint": lambda ctx: ctx["checkpoint"],
    "hf_folder": lambda ctx: ctx["hf_folder"],
}


def make_context(root: Path) -> dict:
    """A checkpoint at step 2 (``resume``'s probe) and a Hugging Face folder (``init_from``'s)
    of the lm job's model, made once in this process."""
    from safetensors.torch import save_file

    root.mkdir(parents=True, exist_ok=True)
    spec = job("lm")
    Trainer(accelerator="cpu", max_steps=2, global_batch_size=16, loggers=(), progress_bar=False,
            report=False, model_summary=False, run_dir=str(root / "made"), resume=None).fit(
        spec["model"], spec["train"], optimizer=adamw, loss_fn=spec["loss"])
    hf = root / "hf"
    hf.mkdir()
    other = gpt()
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(0.5)
    save_file({k: v.clone().contiguous() for k, v in other.state_dict().items()},
              str(hf / "model.safetensors"))
    (hf / "config.json").write_text(json.dumps({"tie_word_embeddings": False}))
    return {"root": str(root), "checkpoint": str(root / "made" / "checkpoints" / "final"),
            "hf_folder": str(hf)}

