"""What the first step's tensor-parallel check costs (meshtrain/parallel/tensor/tp_debug.py).

Under ``tp`` the Trainer compares, after the first step's backward, the gradients of every
parameter replicated over the tp ranks (``tp_check_steps=1`` by default): a few weighted sums per
parameter, one all-reduce over the tp group. This script measures that check against one
training step (forward + backward) of Hugging Face models split by their own plan on 2 ranks
(gloo, CPU, one torch thread per rank): a Llama and a Qwen3 (whose per-head norms are
replicated, so more parameters are checked), hidden size 256, 4 layers, 128 tokens, batch 4.

    python benchmarks/tp_check.py              # 3 warm-up + 15 timed calls, 3 repeats
    python benchmarks/tp_check.py --quick      # smoke run
"""

from __future__ import annotations

import argparse
import statistics

import harness
import torch

SIZES = dict(vocab_size=4096, hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4, intermediate_size=704, max_position_embeddings=128,
             tie_word_embeddings=False, pad_token_id=None, bos_token_id=None, eos_token_id=None)
EXTRA = {"Llama": {}, "Qwen3": {"head_dim": 32}}


def _rank(calls: int, skip: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from meshtrain.models.hf import hf_tp_plan, tiny_causal_lm
    from meshtrain.parallel.tensor.tensor_parallel import apply_tp
    from meshtrain.parallel.tensor.tp_debug import check_replicated_grads, replicated_over_tp

    torch.set_num_threads(1)
    harness.init_gloo(600)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    ids = torch.randint(0, SIZES["vocab_size"], (4, 128), generator=torch.Generator().manual_seed(0))
    result = {}
    for arch, extra in EXTRA.items():
        model = tiny_causal_lm(arch, **SIZES, **extra)
        apply_tp(model, mesh, plan=hf_tp_plan(model, 2))

        def step():
            model.zero_grad(set_to_none=True)
            model(input_ids=ids, labels=ids).loss.backward()

        barrier = torch.distributed.barrier
        step_s = harness.median_time(step, calls, skip, before=barrier)
        check_s = harness.median_time(lambda: check_replicated_grads(model, mesh.get_group()),
                                      calls, skip, before=barrier)
        checked = replicated_over_tp(model)
        result[arch] = {"step_s": step_s, "check_s": check_s,
                        "params_checked": len(checked),
                        "elements_checked": sum(p.to_local().numel() for _, p in checked),
                        "elements": sum(p.to_local().numel() for p in model.parameters())}
    harness.end_process_group()
    return result


def main() -> None:
    from meshtrain.launch.spawn import run_workers

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results/tp_check.json")
    args = parser.parse_args()
    calls, skip, repeats = (4, 1, 1) if args.quick else (18, 3, args.repeats)
    runs = [run_workers(_rank, 2, (calls, skip), timeout=900)[0] for _ in range(repeats)]
    rows, summary = [], {}
    for arch in EXTRA:
        step = [r[arch]["step_s"] for r in runs]
        check = [r[arch]["check_s"] for r in runs]
        ratio = statistics.median(c / s for c, s in zip(check, step))
        first = runs[0][arch]
        summary[arch] = {**first, "step_ms": harness.in_ms(step), "check_ms": harness.in_ms(check),
                         "check_over_step": ratio}
        rows.append([arch, f"{statistics.median(step) * 1e3:.1f}",
                     f"{statistics.median(check) * 1e3:.2f}", f"{ratio:.4f}",
                     f"{first['params_checked']}",
                     f"{first['elements_checked']} of {first['elements']}"])
    print(harness.table(["model (tp=2)", "step ms", "check ms", "check / step",
                         "params checked", "elements checked (rank 0)"], rows))
    if not args.quick:
        harness.write_json(args.out, {"machine": harness.machine(), "calls": calls,
                                      "repeats": repeats, "results": summary})


if __name__ == "__main__":
    main()
