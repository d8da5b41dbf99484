"""Is async ps's gap the algorithm or the implementation? The demo job's async updates, simulated
in one process without RPC: AdamW on the server's parameters, two workers whose half-batch
gradients are computed on a copy of the parameters taken when the pattern says.

    dp      both halves at the current parameters, averaged: one update per step (= dp=2)
    seq     each half at the current parameters, one update each (two updates per step)
    pair    both workers read the same point, then push one after the other: every second
            gradient misses one update (what ps_staleness=0 does)
    delay1  strict alternation, each worker reads right after its own push: every gradient
            misses the other worker's update (what ps_staleness=1 mostly does)

    python benchmarks/ps_staleness.py dp pair delay1 --lr-scale 1 0.5 --steps 400

Validation: the mean loss over 10 fixed batches of 32 validation sequences (not the demo's
exact batches: compare the rows with each other, and their pattern with ps_convergence.py).
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from meshtrain.models.gpt import GPT  # noqa: E402
from meshtrain.recipes import char_lm, resolve_config  # noqa: E402


def simulate(mode: str, lr_scale: float, steps: int) -> dict[int, float]:
    config = resolve_config(str(ROOT / "examples/char_gpt.toml"),
                            [f"--trainer.max_steps={steps}"])[1]
    _, tokenizer, train_tokens, val_tokens = char_lm._data(config)
    opt, seq_len = config["optimizer"], config["data"]["seq_len"]
    server = GPT(char_lm.model_config(config, tokenizer.vocab_size), seed=0)
    workers = [copy.deepcopy(server), copy.deepcopy(server)]
    adamw = torch.optim.AdamW(server.parameters(), lr=opt["lr"], weight_decay=opt["weight_decay"],
                              betas=(opt["beta1"], opt["beta2"]))
    schedule = char_lm.cosine_with_warmup(steps, opt["warmup_steps"], opt["min_lr_ratio"])
    train, val = torch.as_tensor(train_tokens), torch.as_tensor(val_tokens)

    def sequences(tokens, count, generator):
        start = torch.randint(0, len(tokens) - seq_len - 1, (count,), generator=generator)
        x = torch.stack([tokens[i:i + seq_len] for i in start]).long()
        y = torch.stack([tokens[i + 1:i + seq_len + 1] for i in start]).long()
        return x, y

    def loss(model, x, y):
        logits = model(x)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    def gradient(model, batch):
        model.zero_grad(set_to_none=True)
        loss(model, *batch).backward()
        return [p.grad.detach().clone() for p in model.parameters()]

    def push(grads, lr):
        for group in adamw.param_groups:
            group["lr"] = lr
        for p, g in zip(server.parameters(), grads):
            p.grad = g
        adamw.step()

    @torch.no_grad()
    def read(worker):
        for mine, current in zip(workers[worker].parameters(), server.parameters()):
            mine.copy_(current)

    data, held_out = torch.Generator().manual_seed(0), torch.Generator().manual_seed(1)
    vx, vy = sequences(val, 320, held_out)
    result = {}
    for step in range(steps):
        lr = opt["lr"] * lr_scale * schedule(step)
        halves = [sequences(train, 16, data), sequences(train, 16, data)]
        if mode == "dp":
            read(0)
            g0, g1 = (gradient(workers[0], half) for half in halves)
            push([(a + b) / 2 for a, b in zip(g0, g1)], lr)
        elif mode == "seq":
            for w in (0, 1):
                read(w)
                push(gradient(workers[w], halves[w]), lr)
        elif mode == "pair":
            read(0)
            read(1)
            grads = [gradient(workers[w], halves[w]) for w in (0, 1)]
            for g in grads:
                push(g, lr)
        elif mode == "delay1":
            if step == 0:
                read(0)
                read(1)
            for w in (0, 1):
                push(gradient(workers[w], halves[w]), lr)
                read(w)
        if (step + 1) % (steps // 4) == 0:
            with torch.no_grad():
                result[step + 1] = sum(loss(server, vx[i:i + 32], vy[i:i + 32]).item()
                                       for i in range(0, 320, 32)) / 10
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("modes", nargs="+", choices=["dp", "seq", "pair", "delay1"])
    parser.add_argument("--lr-scale", type=float, nargs="+", default=[1.0])
    parser.add_argument("--steps", type=int, default=400)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"{'mode':8} {'lr':>6} " + " ".join(f"val@{s * args.steps // 4:<5}" for s in range(1, 5)))
    for mode in args.modes:
        for scale in args.lr_scale:
            val = simulate(mode, scale, args.steps)
            print(f"{mode:8} {scale:>6.2f} " + " ".join(f"{v:<9.4f}" for v in val.values()),
                  flush=True)


if __name__ == "__main__":
    main()
