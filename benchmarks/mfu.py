"""Model FLOPs utilisation (MFU) of meshtrain training a ~1B-parameter Llama on one GPU.

A ``transformers`` ``LlamaForCausalLM`` built from a config (nothing downloaded; by default the
shape of examples/llama_1b_zero3.toml: hidden 2048, 16 layers, 32 heads, 8 kv heads, MLP 8192,
vocabulary 32000, ~1.1B parameters), SDPA attention, trained on random tokens through
``meshtrain.Trainer`` in one process (precision "bf16-mixed": float32 master weights and AdamW
state, bf16 autocast), ``compile=True`` (torch.compile of each decoder layer) by default. A
callback takes a timestamp at the end of every optimizer step (after ``torch.cuda.synchronize``
on a GPU); the first ``--warmup`` steps (compilation, allocator warm-up) are left out and their
time is reported on its own, then the step time is the mean over the ``--steps`` timed steps.

    tokens/s    = global_batch x seq_len / step time
    FLOPs/token = 6 * N + 12 * L * H * T
    MFU         = tokens/s x FLOPs/token / peak bf16 dense FLOP/s of the device

N: the parameters that take part in matmuls, i.e. all parameters less the input embedding table
(a lookup); the output head (lm_head, vocab x hidden) is counted, also when tied. 6N: forward
(2N) and backward (4N). L layers, H hidden size (= heads x head dim), T = seq_len: the attention
scores and the weighted values, 4*H*T FLOPs per token and layer forward, x3 with the backward.
Convention: PaLM (Chowdhery et al. 2022, appendix B) and torchtitan, *without* halving for the
causal mask, so the numbers compare with theirs; the JSON also holds ``mfu_causal``, with the
attention term halved (what a causal flash kernel actually computes). Recomputation under
activation checkpointing is not counted (MFU, not hardware FLOPs utilisation). Peaks: H100 SXM
and H200 989.4 TFLOP/s, H100 PCIe 756, H100/H200 NVL 835.5, A100 312 (NVIDIA datasheets,
dense); ``--peak-tflops`` overrides; on a CPU no MFU is given. Peak memory is
torch.cuda.max_memory_allocated / max_memory_reserved over the whole run.

``--float8 tensorwise|rowwise``: the Trainer's ``float8`` setting (torchao's float8 linears,
every decoder layer's projections, not lm_head; docs/precision.md), everything else the same, so
float8 against bf16 tokens/s on this model is this one flag. MFU stays against the bf16 dense
peak (the same FLOPs per token and denominator as the bf16 run: the MFU ratio is the tokens/s
ratio). Without torchao the run says "torchao not installed", writes ``--out`` with that reason
and ends with status 2. ``--float8-emulate``: torchao's emulation (the matmuls in high
precision, any device): a CPU smoke run of the float8 path, not a speed.

    python benchmarks/mfu.py --steps 300 --out benchmarks/results/mfu_h100.json
    python benchmarks/mfu.py --steps 300 --compile false --out benchmarks/results/mfu_eager.json
    python benchmarks/mfu.py --micro-batch 8 --activation-checkpointing selective
    python benchmarks/mfu.py --vocab 128256         # Llama 3's vocabulary (~1.5B parameters)
    python benchmarks/mfu.py --steps 150 --float8 tensorwise --out results/mfu_h100_float8.json
    python benchmarks/mfu.py --tiny                 # CPU smoke run: 2 small layers, a few steps
    python benchmarks/mfu.py --tiny --compile false
    python benchmarks/mfu.py --tiny --compile false --float8 tensorwise --float8-emulate
"""

from __future__ import annotations

import argparse
import importlib.util
import shlex
import sys
import tempfile
import time

import torch
from harness import fmt, machine, table, write_json
from overhead import StepClock

GIB = 2**30
# (substrings that must all be in torch.cuda.get_device_name(), peak bf16 dense FLOP/s); first
# match wins. H100 SXM reports e.g. "NVIDIA H100 80GB HBM3".
PEAK_BF16 = ((("H100", "PCIe"), 756e12), (("NVL",), 835.5e12), (("H100",), 989.4e12),
             (("H200",), 989.4e12), (("A100",), 312e12))
ONE_B = {"hidden": 2048, "layers": 16, "heads": 32, "kv_heads": 8, "intermediate": 8192,
         "vocab": 32000, "seq_len": 2048, "micro_batch": 4, "steps": 200, "warmup": 20}
TINY = {"hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2, "intermediate": 128,
        "vocab": 1024, "seq_len": 128, "micro_batch": 2, "steps": 5, "warmup": 2}


def peak_flops(device_name: str) -> float | None:
    for keys, peak in PEAK_BF16:
        if all(key in device_name for key in keys):
            return peak
    return None


def llama_config(args):
    import transformers

    return transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        intermediate_size=args.intermediate, max_position_embeddings=max(args.seq_len, 2048),
        attention_dropout=0.0, tie_word_embeddings=False, use_cache=False,
        attn_implementation="sdpa")


def model_factory(config, seed: int = 0):
    """What ``Trainer.fit`` gets: meshtrain builds the model (seeded, SDPA) when it needs it."""
    import transformers

    from meshtrain.models.hf import build_seeded

    return lambda: build_seeded(transformers.LlamaForCausalLM, config, seed)


def count_params(config) -> dict:
    """Parameter counts of the model, built on the meta device (no memory, no time)."""
    with torch.device("meta"):
        model = model_factory(config)()
    total = sum(p.numel() for p in model.parameters())
    embedding = model.get_input_embeddings().weight.numel()
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    return {"total": total, "embedding": embedding,
            "matmul": total - embedding + (embedding if tied else 0)}


def flops_per_token(config, n_matmul: int, seq_len: int) -> tuple[float, float]:
    """(PaLM/torchtitan FLOPs per token, the same with the attention term halved for causality)."""
    attention = 12 * config.num_hidden_layers * config.hidden_size * seq_len
    return 6 * n_matmul + attention, 6 * n_matmul + attention / 2


def parse_compile(value: str):
    options = {"true": True, "blocks": "blocks", "false": False, "model": "model"}
    if value.lower() not in options:
        raise argparse.ArgumentTypeError(f"one of {', '.join(options)}, got {value!r}")
    return options[value.lower()]


def run(args) -> dict:
    from meshtrain import Callback, Trainer
    from meshtrain.models.hf import random_token_data
    from meshtrain.optim import AdamW

    cuda = args.accelerator == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    clock, marks = StepClock(args.warmup, args.steps), {}

    class Clock(Callback):
        def on_train_step_start(self, trainer) -> None:
            if "first_start" not in marks:
                sync()
                marks["first_start"] = time.perf_counter()

        def on_train_step_end(self, trainer, metrics: dict) -> None:
            sync()  # the step's kernels have run: the timestamp is the step's real end
            clock.step_end()

    config, total = llama_config(args), args.warmup + args.steps
    data = random_token_data(args.global_batch * total, args.seq_len, args.vocab, seed=0)
    optimizer_options = {"fused": True} if cuda else {}  # one kernel for the whole update
    with tempfile.TemporaryDirectory(prefix="meshtrain-mfu-") as run_dir:
        trainer = Trainer(
            accelerator=args.accelerator, devices=1, precision="bf16-mixed",
            micro_batch_size=args.micro_batch, global_batch_size=args.global_batch,
            max_steps=total, compile=args.compile, float8=args.float8,
            float8_emulate=args.float8_emulate,
            activation_checkpointing=None if args.activation_checkpointing == "none"
            else args.activation_checkpointing,
            nan_policy=None if args.nan_policy == "none" else args.nan_policy,
            seed=0, shuffle=False, callbacks=[Clock()], loggers=(), progress_bar=False,
            save_final_checkpoint=False, run_dir=run_dir, resume=None,
            # the first log (where the Trainer counts the model's FLOPs on a meta copy, a
            # one-off second or more) ends the warm-up, outside the timed steps
            log_every_n_steps=args.warmup)
        started = time.perf_counter()
        model = trainer.fit(model_factory(config), data, loss_fn=None,
                            optimizer=AdamW(lr=3e-4, weight_decay=0.1, **optimizer_options))
        sync()
        device = trainer.device
        # the layers that ran in float8 (torchao's Float8Linear), counted on the trained model
        float8_layers = sum(type(m).__name__ == "Float8Linear" for m in model.modules())
        del model
    timing = clock.result("mfu")
    ends, first = clock.ends, marks["first_start"]
    result = {
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "float8": args.float8, "float8_emulate": args.float8_emulate,
        "float8_layers": float8_layers,
        "setup_s": first - started,  # build the model, move it, apply the layout
        "first_step_s": ends[0] - first,  # most of the compilation
        "warmup_s": ends[args.warmup - 1] - first,  # the untimed steps, compilation included
        "step_s": timing["mean_step_s"], "median_step_s": timing["median_step_s"],
        "tokens_per_step": args.global_batch * args.seq_len,
        "train_loss": trainer.callback_metrics.get("train/loss"),  # random tokens: ~ln(vocab)
        "peak_allocated_gib": torch.cuda.max_memory_allocated(device) / GIB if cuda else None,
        "peak_reserved_gib": torch.cuda.max_memory_reserved(device) / GIB if cuda else None,
    }
    result["tokens_per_s"] = result["tokens_per_step"] / result["step_s"]
    return result


def add_mfu(result: dict, params: dict, config, args) -> None:
    palm, causal = flops_per_token(config, params["matmul"], args.seq_len)
    peak = args.peak_tflops * 1e12 if args.peak_tflops else (
        peak_flops(result["device"]) if args.accelerator == "cuda" else None)
    achieved = result["tokens_per_s"] * palm
    result.update(flops_per_token=palm, flops_per_token_causal=causal,
                  achieved_tflops=achieved / 1e12, peak_tflops=peak / 1e12 if peak else None,
                  mfu=achieved / peak if peak else None,
                  mfu_causal=result["tokens_per_s"] * causal / peak if peak else None)


def precision_name(args) -> str:
    if not args.float8:
        return "bf16-mixed"
    return f"bf16-mixed + float8 {args.float8}" + (" (emulated)" if args.float8_emulate else "")


def format_table(result: dict, params: dict, args) -> str:
    def na(value, spec: str, unit: str = "") -> str:  # "n/a" where there is no value (CPU)
        return "n/a" if value is None else format(value, spec) + unit

    r, m, steps = result, 1e3, f"({args.warmup} steps)"
    pct = {key: na(None if r[key] is None else 100 * r[key], ".1f", " %")
           for key in ("mfu", "mfu_causal")}
    rows = [
        ("device", r["device"]),
        ("parameters (in matmuls)", f"{params['total']:,} ({params['matmul']:,})"),
        ("compile / act. checkpointing", f"{args.compile} / {args.activation_checkpointing}"),
        ("precision", precision_name(args)
         + (f" ({r['float8_layers']} float8 layers)" if args.float8 else "")),
        ("tokens per step", f"{r['tokens_per_step']:,} ({args.global_batch} x {args.seq_len})"),
        ("step time mean (median)", f"{m * r['step_s']:.1f} ms ({m * r['median_step_s']:.1f})"),
        ("tokens/s", f"{r['tokens_per_s']:,.0f}"),
        ("achieved TFLOP/s", f"{r['achieved_tflops']:.3g}"),
        ("peak TFLOP/s (bf16 dense)", na(r["peak_tflops"], ".1f")),
        ("MFU (attention halved)", f"{pct['mfu']} ({pct['mfu_causal']})"),
        ("peak memory allocated", na(r["peak_allocated_gib"], ".2f", " GiB")),
        ("peak memory reserved", na(r["peak_reserved_gib"], ".2f", " GiB")),
        ("setup (build + place model)", f"{r['setup_s']:.1f} s"),
        ("first step / warm-up", f"{r['first_step_s']:.1f} s / {r['warmup_s']:.1f} s {steps}"),
        ("train loss (mean over the run)", fmt(r["train_loss"], ".3f")),
    ]
    return table(("measure", "value"), rows, left=2)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run: a 2-layer model")
    for name in ("steps", "warmup", "seq-len", "micro-batch", "layers", "hidden", "heads",
                 "kv-heads", "intermediate", "vocab"):
        parser.add_argument(f"--{name}", type=int, default=None,
                            help=f"default {ONE_B[name.replace('-', '_')]} (--tiny: "
                                 f"{TINY[name.replace('-', '_')]})")
    parser.add_argument("--global-batch", type=int, default=None,
                        help="samples per optimizer step (default: the micro-batch)")
    parser.add_argument("--compile", type=parse_compile, default=True,
                        help="true/blocks (each decoder layer), model (the whole forward) or false")
    parser.add_argument("--activation-checkpointing", default="none",
                        choices=("none", "full", "selective"))
    parser.add_argument("--nan-policy", default="error", choices=("error", "none"),
                        help="meshtrain's per-step NaN/Inf check (default error, the Trainer's)")
    parser.add_argument("--accelerator", default="auto", choices=("auto", "cuda", "cpu"))
    parser.add_argument("--float8", default=None, choices=("tensorwise", "rowwise"),
                        help="the Trainer's float8 setting (torchao); default off (bf16-mixed)")
    parser.add_argument("--float8-emulate", action="store_true",
                        help="torchao's float8 emulation (any device; numerics, not speed)")
    parser.add_argument("--peak-tflops", type=float, help="the device's peak, overriding the table")
    parser.add_argument("--out", help="also write the results as JSON here")
    args = parser.parse_args(argv)
    for key, value in (TINY if args.tiny else ONE_B).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.global_batch = args.global_batch or args.micro_batch
    if args.accelerator == "auto":
        args.accelerator = "cuda" if torch.cuda.is_available() else "cpu"
    if min(args.steps, args.warmup, args.micro_batch) < 1 or args.global_batch % args.micro_batch:
        parser.error("--steps, --warmup, --micro-batch must be >= 1 and --global-batch a "
                     "multiple of --micro-batch")
    if args.float8_emulate and not args.float8:
        parser.error("--float8-emulate goes with --float8")
    return args


def payload(args, **parts) -> dict:
    cuda = args.accelerator == "cuda"
    info = {"gpu": torch.cuda.get_device_name(), "cuda": torch.version.cuda} if cuda else {}
    return {"command": shlex.join(["python", *sys.argv]),
            "config": {k: v for k, v in vars(args).items() if k != "out"}, **parts,
            "machine": machine(**info)}


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.float8 and importlib.util.find_spec("torchao") is None:
        reason = "torchao not installed"
        print(f"mfu benchmark: --float8 {args.float8}: {reason} (pip install "
              "'meshtrain[float8]'); no float8 run", flush=True)
        if args.out:
            print(f"wrote {write_json(args.out, payload(args, skipped=reason), indent=2)}")
        return 2
    config = llama_config(args)
    params = count_params(config)
    print(f"mfu benchmark: Llama {args.layers} layers, hidden {args.hidden}, {args.heads} heads "
          f"({args.kv_heads} kv), MLP {args.intermediate}, vocabulary {args.vocab}: "
          f"{params['total']:,} parameters; seq_len {args.seq_len}, micro-batch "
          f"{args.micro_batch}, global batch {args.global_batch}, {precision_name(args)}, compile="
          f"{args.compile}, on {args.accelerator}; {args.warmup} warm-up + {args.steps} timed "
          f"steps, torch {torch.__version__}", flush=True)
    result = run(args)
    add_mfu(result, params, config, args)
    print()
    print(format_table(result, params, args))
    if args.out:
        written = write_json(args.out, payload(args, params=params, result=result), indent=2)
        print(f"\nwrote {written}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
