"""Hugging Face MoE families nobody tuned meshtrain for, under ep, against plain transformers.

Each family is built tiny from its config (4 experts, top-2, 2 layers), trained 2 steps in
float64 by transformers alone and by meshtrain under ``ep=2`` and ``dp_shard=2,ep=2`` (the
tests' harness: tests/models/test_hf_moe.py); every weight is compared at 1e-9 relative,
except the tensors a model keeps in float32 on purpose (``_keep_in_fp32_modules_strict``, the
routers of DeepSeek-like models), judged at 1e-6. Randomness in training is switched off
(``router_jitter_noise=0``: PhiMoE draws router noise per rank, as dropout does).

    python benchmarks/moe_families.py                 # every family below
    python benchmarks/moe_families.py Qwen2Moe Olmoe  # some

One line per family and layout: EQUAL, or where it differs.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "models")]

FAMILIES = ["Qwen2Moe", "Olmoe", "GraniteMoe", "GraniteMoeShared", "Phimoe", "HunYuanMoEV1",
            "MiniMax", "Cohere2Moe", "DeepseekV2", "ExaoneMoe", "Glm4Moe", "Ernie4_5_Moe",
            "Dots1", "Lfm2Moe", "FlexOlmo"]
SIZES = dict(vocab_size=32, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=2, head_dim=8, max_position_embeddings=16, intermediate_size=16,
             moe_intermediate_size=8, num_experts=4, num_local_experts=4, n_routed_experts=4,
             num_experts_per_tok=2, first_k_dense_replace=0, n_group=1, topk_group=1,
             shared_expert_intermediate_size=8, n_shared_experts=1, kv_lora_rank=8,
             q_lora_rank=None, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8,
             decoder_sparse_step=1, mlp_only_layers=[], output_router_logits=False,
             router_jitter_noise=0.0, pad_token_id=0, eos_token_id=1, bos_token_id=1,
             layer_types=["full_attention", "full_attention"], num_dense_layers=1)
LAYOUTS = ("ep=2", "dp_shard=2,ep=2")


def tiny(architecture: str):
    """A tiny ``architecture`` model: the sizes above that its config has."""
    import transformers

    from meshtrain.models.hf import tiny_causal_lm

    default = getattr(transformers, f"{architecture}Config")()
    config = {k: v for k, v in SIZES.items() if hasattr(default, k)}
    return tiny_causal_lm(architecture, experts_implementation="eager", **config)


def check(architecture: str) -> list[str]:
    from parity import LOSSES, compare_ranks
    from test_hf_moe import meshtrain_ranks, plain_transformers

    build = functools.partial(tiny, architecture)
    build.__name__ = architecture
    try:
        model = build()
        reference = plain_transformers(build, steps=2)
    except Exception as error:  # noqa: BLE001 -- a family this transformers cannot build tiny
        return [f"{architecture}: not built: {error!r}"[:300]]
    reference.pop(LOSSES)
    kept = [k for k in reference
            if any(f in k for f in getattr(type(model), "_keep_in_fp32_modules_strict", None)
                   or [])]
    rest = [k for k in reference if k not in kept]
    lines = []
    for layout in LAYOUTS:
        try:
            ranks = meshtrain_ranks(build, layout, 2, steps=2)
            for names, tol in ((rest, 1e-9), (kept, 1e-6)):
                if names:
                    compare_ranks({k: reference[k] for k in names},
                                  [{k: r[k] for k in names} for r in ranks], tol=tol,
                                  relative=True, label=f"{architecture} {layout}")
            lines.append(f"{architecture} {layout}: EQUAL ({len(rest)} tensors at 1e-9, "
                         f"{len(kept)} float32-kept at 1e-6)")
        except Exception as error:  # noqa: BLE001 -- reported, the next one runs
            lines.append(f"{architecture} {layout}: DIFFERS "
                         + " | ".join(str(error).strip().splitlines()[-2:])[:400])
    return lines


def main() -> None:
    for architecture in sys.argv[1:] or FAMILIES:
        for line in check(architecture):
            print(line, flush=True)


if __name__ == "__main__":
    main()
