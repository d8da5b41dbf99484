"""Llama 3 8B, 70B and 405B built under the layouts they were trained with, at their world sizes
(8 to 1024 ranks), in this one process: meshtrain.plan.simulate (torch's fake process group, the
meta device, the Trainer's own layout code). Per rank: the parameters stored there and the
model-state bytes (fp32 parameters and gradients, AdamW's two fp32 moments), and the seconds the
build took. Pipeline ranks differ (the first stage holds the embedding, the last the head), so
the first and the last rank are shown.

    python benchmarks/simulate_at_scale.py
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import machine, table, write_json  # noqa: E402

from meshtrain.plan.simulate import simulate  # noqa: E402

# (model, layout): 8B with FSDP alone on one 8-GPU node; 70B with tp 8 inside a node and FSDP
# across 8 and 32 nodes; 405B as Llama 3's pre-training ran it, tp 8 x pp 16 x dp 8.
CASES = [("8b", "dp_shard=8"), ("70b", "dp_shard=8,tp=8"), ("70b", "dp_shard=32,tp=8"),
         ("405b", "pp=16,dp_shard=8,tp=8")]
GIB = 2 ** 30


def llama(name: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig.from_json_file(ROOT / "examples" / "llama3" / f"{name}.json")
    return lambda: LlamaForCausalLM(config)


def main() -> None:
    rows, results = [], []
    for name, layout in CASES:
        world = 1
        for part in layout.split(","):
            world *= int(part.split("=")[1])
        for rank in sorted({0, world - 1}):
            state = simulate(llama(name), layout, rank=rank)
            results.append({"model": name, "layout": layout, **vars(state)})
            rows.append([name, layout, str(world), str(rank), f"{state.num_params / 1e9:.2f}",
                         f"{state.local_params / 1e6:.1f}", f"{state.params / GIB:.2f}",
                         f"{state.total / GIB:.2f}", f"{state.seconds:.1f}"])
            print(rows[-1], flush=True)
    print(table(["model", "layout", "ranks", "rank", "params (B)", "on rank (M)",
                 "params GiB", "model state GiB", "build s"], rows))
    write_json(ROOT / "benchmarks" / "results" / "simulate_at_scale.json",
               {"machine": machine(), "rows": results})


if __name__ == "__main__":
    main()
