"""Small user models the suite's parity helpers were not tuned on, as `meshtrain parity` entry
points (``cd tests; meshtrain parity parity_models:attention_job --layouts "dp=2;pp=2"``).

* ``attention_job``: a transformer written as a user would, with biases on every projection.
  Its attention key bias has a true gradient of exactly zero (softmax ignores a shift shared by
  all keys), so AdamW moves it by rounding noise alone: under a fixed tolerance it "failed"
  every layout although all were right.
* ``cnn_job``: a CNN with BatchNorm2d. torch's fp32 CPU BatchNorm2d, the one-process run, is
  off from a float64 computation by far more (5e-4 relative on running_var) than the layouts.
* ``*_bug`` jobs: a real layout bug (gradients doubled on more than one process) and BatchNorm
  statistics per rank (``sync_batchnorm=False``): both must still fail.
"""
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from meshtrain import Callback

VOCAB, SEQ, WIDTH, HEADS = 32, 16, 32, 4


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(WIDTH, WIDTH) for _ in range(4))

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (lin(x).view(b, t, HEADS, -1).transpose(1, 2) for lin in (self.q, self.k, self.v))
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        return self.o((att @ v).transpose(1, 2).reshape(b, t, WIDTH))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.attn = Attention()
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(),
                                 nn.Linear(2 * WIDTH, WIDTH))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyTransformer(nn.Module):
    def __init__(self, layers: int = 2):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, WIDTH)
        self.pos = nn.Embedding(SEQ, WIDTH)
        self.layers = nn.ModuleList(Block() for _ in range(layers))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def embed(self, idx):  # (what pipeline stage 0 runs before the blocks)
        return self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))

    def forward(self, idx):
        x = self.embed(idx)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def transformer():
    torch.manual_seed(0)
    return TinyTransformer()


def tokens(n: int = 64) -> TensorDataset:
    gen = torch.Generator().manual_seed(3)
    seq = torch.randint(0, VOCAB, (n, SEQ + 1), generator=gen)
    return TensorDataset(seq[:, :-1], seq[:, 1:])


def lm_loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)


def attention_job() -> dict:
    return dict(model=transformer, train_data=tokens(), optimizer=adamw, loss_fn=lm_loss,
                settings=dict(global_batch_size=8))


class DoubledGradients(Callback):
    """A layout bug: the gradients of a run on more than one process are twice the true ones."""

    def on_before_optimizer_step(self, trainer):
        if trainer.world_size > 1:
            for p in trainer.model.parameters():
                if p.grad is not None:
                    p.grad.mul_(2)


def attention_bug_job() -> dict:
    job = attention_job()
    job["settings"]["callbacks"] = [DoubledGradients()]
    return job


class ConvNet(nn.Module):
    def __init__(self, channels=(3, 8, 8, 16, 16)):
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out),
                          nn.ReLU())
            for c_in, c_out in zip(channels, channels[1:]))
        self.head = nn.Linear(channels[-1], 10)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean((2, 3)))


def convnet():
    torch.manual_seed(0)
    return ConvNet()


def images(n: int = 64) -> TensorDataset:
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(n, 3, 16, 16, generator=gen) * 30 + 10  # large activations and variances
    return TensorDataset(x, torch.randint(0, 10, (n,), generator=gen))


def cnn_job() -> dict:
    return dict(model=convnet, train_data=images(), optimizer=adamw, loss_fn=F.cross_entropy,
                settings=dict(global_batch_size=16))


def cnn_unsynced_job() -> dict:
    job = cnn_job()
    job["settings"]["sync_batchnorm"] = False
    return job


# A transformer written for tensor parallel by its user: heads reshaped with local sizes, a
# per-head norm on the queries (Qwen3's q_norm), and its own plan. ``tp_missing_sum_job``: the
# same plan without the norm's entry, so the norm sees this rank's heads only and its gradient
# is a share nobody sums (the tp guard would stop it at step 1; it is off there, so that
# `meshtrain parity`'s own verdict is what tells).
class TPAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.head_dim = WIDTH // HEADS
        self.q, self.k, self.v, self.o = (nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(4))
        self.q_norm = nn.LayerNorm(self.head_dim)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (lin(x).view(b, t, -1, self.head_dim).transpose(1, 2)
                   for lin in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(self.q_norm(q), k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class TPBlock(Block):
    def __init__(self):
        super().__init__()
        self.attn = TPAttention()


class TPTransformer(TinyTransformer):
    def __init__(self, layers: int = 2, norm_entry: bool = True):
        super().__init__(layers)
        self.layers = nn.ModuleList(TPBlock() for _ in range(layers))
        self.norm_entry = norm_entry

    def tp_plan(self, tp_degree, *, sequence_parallel=False, loss_parallel=False):
        from meshtrain.parallel.tensor.tensor_parallel import ReplicateParallel, attention_plan, mlp_plan

        plan = {}
        for i in range(len(self.layers)):
            plan.update(attention_plan(f"layers.{i}.attn", "q", "k", "v", "o"))
            plan.update(mlp_plan(f"layers.{i}.mlp", "0", "2"))
            if self.norm_entry:  # its gradient: this rank's heads' share, summed over tp
                plan[f"layers.{i}.attn.q_norm"] = ReplicateParallel(local_input=True)
        return plan


def tp_transformer_job() -> dict:
    def model():
        torch.manual_seed(0)
        return TPTransformer()
    return dict(model=model, train_data=tokens(), optimizer=adamw, loss_fn=lm_loss,
                settings=dict(global_batch_size=8))


def tp_missing_sum_job() -> dict:
    def model():
        torch.manual_seed(0)
        return TPTransformer(norm_entry=False)
    return dict(model=model, train_data=tokens(), optimizer=adamw, loss_fn=lm_loss,
                settings=dict(global_batch_size=8, tp_check_steps=0))


# A model that computes its norms in float32 on purpose, as Gemma's RMSNorm does (x.float()):
# cast to float64 it is float64 everywhere else, so its float64 runs part by ~1e-8 under any
# change of the order of sums (its own floor), which `meshtrain parity` measures and judges by.
class Float32RMSNorm(nn.Module):
    def __init__(self, width: int = WIDTH):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x):
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6)
        return (y * self.weight.float()).type_as(x)


def float32_norm_transformer():
    torch.manual_seed(0)
    model = TinyTransformer()
    for block in model.layers:
        block.ln1, block.ln2 = Float32RMSNorm(), Float32RMSNorm()
    model.norm = Float32RMSNorm()
    return model


def float32_norm_job() -> dict:
    return dict(model=float32_norm_transformer, train_data=tokens(), optimizer=adamw,
                loss_fn=lm_loss, settings=dict(global_batch_size=8))


def float32_norm_bug_job() -> dict:
    """The same model with gradients doubled on 2 processes: its floor must not hide a bug."""
    job = float32_norm_job()
    job["settings"]["callbacks"] = [DoubledGradients()]
    return job


# A user's attention block with a hand-written tp plan's shapes (heads reshaped with the local
# sizes), as source text: a `meshtrain parity` job module (tests/test_parity_command.py) and a
# script run under tp=2 (tests/test_public_api.py) are written from it.
TP_USER_BLOCK = """
import torch
from torch.utils.data import TensorDataset


class Attention(torch.nn.Module):
    def __init__(self, dim=16, heads=2):
        super().__init__()
        self.head_dim = dim // heads
        # no biases: a key bias has an exactly zero true gradient (softmax ignores a shift
        # shared by all keys), which AdamW turns from rounding noise into lr-sized steps
        self.q, self.k, self.v, self.out = (torch.nn.Linear(dim, dim, bias=False)
                                            for _ in range(4))

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (f(x).view(b, s, -1, self.head_dim).transpose(1, 2)
                   for f in (self.q, self.k, self.v))  # local heads under tp
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, s, -1))


class Block(torch.nn.Module):
    def __init__(self, dim=16):
        super().__init__()
        self.attn = Attention(dim)
        self.fc_in, self.fc_out = torch.nn.Linear(dim, 4 * dim), torch.nn.Linear(4 * dim, dim)

    def forward(self, x):
        x = x + self.attn(x)
        return x + self.fc_out(torch.nn.functional.gelu(self.fc_in(x)))


def data():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 6, 16, generator=gen)
    return TensorDataset(x, x.roll(1, dims=1))
"""
