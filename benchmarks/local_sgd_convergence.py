"""Local SGD against synchronous dp=2 on the test suite's MLP (tests/parity.py): full-data loss
after 30 SGD-with-momentum steps, global batch 16, for plain averaging every 4 steps and DiLoCo's
outer step at two momenta. Run: python benchmarks/local_sgd_convergence.py (about 30 s)."""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import torch  # noqa: E402
from conftest import full_loss, sgd_momentum  # noqa: E402
from parity import mlp, params_of, regression_data, run_layout, run_ranks  # noqa: E402

STEPS = 30


def data_loss(state: dict) -> float:
    model = mlp()
    model.load_state_dict(params_of(state))
    return full_loss(model, regression_data())


if __name__ == "__main__":
    os.environ["OMP_NUM_THREADS"] = "1"
    base = {"layout": "dp=2", "devices": 2, "max_steps": STEPS, "global_batch_size": 16}
    torch.manual_seed(0)
    print(f"start                          {full_loss(mlp(), regression_data()):.3f}")
    sync = run_layout(base, 2, optimizer_fn=sgd_momentum)
    print(f"dp=2, gradients every step     {data_loss(sync):.3f}")
    for label, extra in (("H=4, plain average", {}),
                         ("H=4, DiLoCo 0.7, momentum 0.5", {"outer_lr": 0.7, "outer_momentum": 0.5}),
                         ("H=4, DiLoCo 0.7, momentum 0.9", {"outer_lr": 0.7, "outer_momentum": 0.9})):
        ranks = run_ranks({**base, "local_sgd_every": 4, **extra}, 2, optimizer_fn=sgd_momentum)
        print(f"{label:30s} {data_loss(ranks[0]):.3f}")
