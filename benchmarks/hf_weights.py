"""Hugging Face weights into a sharded model: meshtrain's reader against DCP's.

A Llama of ``--hidden``/``--layers`` (about 134M parameters at the defaults, 537 MB of fp32)
is written once with ``save_pretrained`` (safetensors shards of ``--shard-mb``), then loaded on
``--world-size`` processes (gloo, CPU, one torch thread each) into the model laid out as
``--layout``: ``zero3`` (FSDP2 ``fully_shard`` per decoder layer and at the root, ``Shard(0)``
DTensors) or ``tp`` (transformers' own tp plan through meshtrain's ``apply_tp``, ``Shard(0)``
and ``Shard(1)``). Each repeat loads with both, in turns (the order rotating per repeat):

* ``meshtrain``: ``meshtrain.checkpoint.hf_weights.load_hf_weights`` (each rank reads its
  slices with safetensors' ``get_slice``; meshtrain's name, shape and tie checks first);
* ``dcp``: ``torch.distributed.checkpoint.load`` of ``model.state_dict()`` with
  ``HuggingFaceStorageReader`` (DCP's planner decides each rank's reads).

``--export``: the other way, in one process (as ``meshtrain export --hf`` runs): the model's
whole state written as safetensors shards of ``--shard-mb`` by meshtrain's ``_write_shards``
(safetensors' ``save_file`` per shard, then the index) and by ``dcp.save`` with
``HuggingFaceStorageWriter`` (the same names to the same shard numbers), in turns; each output
read back and compared with the state.

Per load, the slower rank's seconds and the peak resident memory it added (``PeakRSS``), and a
check that both gave every rank the same local values (bit for bit). The model's parameters
are zeroed before each load.

    python benchmarks/hf_weights.py                      # zero3, 2 ranks, 3 repeats
    python benchmarks/hf_weights.py --layout tp
    python benchmarks/hf_weights.py --export
    python benchmarks/hf_weights.py --layers 2 --repeats 1   # smoke run
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from harness import init_gloo, machine, spread, table, write_json

from meshtrain.launch.spawn import run_workers

METHODS = ("meshtrain", "dcp")


def _config(args):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                       intermediate_size=args.hidden * 8 // 3, num_hidden_layers=args.layers,
                       num_attention_heads=args.hidden // 64,
                       num_key_value_heads=args.hidden // 128, tie_word_embeddings=False)


def write_folder(args, folder: Path) -> int:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(_config(args))
    model.save_pretrained(folder, max_shard_size=f"{args.shard_mb}MB")
    return sum(p.numel() for p in model.parameters())


def _laid_out(cfg: dict, folder: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig.from_pretrained(folder)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    if cfg["layout"] == "zero3":
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    else:
        from torch.distributed.device_mesh import init_device_mesh

        from meshtrain.models.hf.tp import hf_tp_plan
        from meshtrain.parallel.tensor.tensor_parallel import apply_tp

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        apply_tp(model, mesh, plan=hf_tp_plan(model, dist.get_world_size()))
    model.to_empty(device="cpu")
    return model


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def bench_worker(cfg: dict, folder: str) -> dict:
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    from meshtrain.checkpoint.hf_weights import load_hf_weights
    from meshtrain.observe.memory.peak_rss import PeakRSS

    rank = init_gloo(cfg["timeout"])
    model = _laid_out(cfg, folder)

    def load(method: str) -> None:
        if method == "meshtrain":
            load_hf_weights(model, folder)
        else:
            torch.distributed.checkpoint.load(
                model.state_dict(), storage_reader=HuggingFaceStorageReader(folder))

    load("dcp")  # one-time costs of each (imports, the files into the page cache), untimed
    load("meshtrain")
    rows, values = [], {}
    for rep in range(cfg["repeats"]):
        row = {}
        turn = rep % len(METHODS)
        for method in METHODS[turn:] + METHODS[:turn]:
            with torch.no_grad():
                for p in model.parameters():
                    _local(p).zero_()
            dist.barrier()
            with PeakRSS() as peak:
                start = time.perf_counter()
                load(method)
                row[f"{method}_s"] = time.perf_counter() - start
            row[f"{method}_rss_mib"] = peak.bytes / 2**20
            dist.barrier()
            if rep == 0:
                values[method] = {n: _local(p).detach().clone()
                                  for n, p in model.named_parameters()}
        rows.append(row)
    same = all(torch.equal(values["meshtrain"][n], values["dcp"][n]) for n in values["dcp"])
    nonzero = any(bool(v.abs().sum()) for v in values["dcp"].values())
    return {"rank": rank, "rows": rows, "same": same and nonzero}


def summarize(ranks: list[dict]) -> dict:
    repeats = len(ranks[0]["rows"])
    slower = [{k: max(r["rows"][i][k] for r in ranks) for k in ranks[0]["rows"][i]}
              for i in range(repeats)]
    out = {k: spread(row[k] for row in slower) for k in slower[0]}
    out["dcp_over_meshtrain"] = [row["dcp_s"] / row["meshtrain_s"] for row in slower]
    out["same_values"] = all(r["same"] for r in ranks)
    out["per_repeat"] = slower
    return out


def format_table(summary: dict) -> str:
    rows = []
    for method in METHODS:
        t, m = summary[f"{method}_s"], summary[f"{method}_rss_mib"]
        rows.append((method, f"{t['median']:.3f}", f"{t['min']:.3f}", f"{t['max']:.3f}",
                     f"{m['median']:.0f}"))
    ratios = sorted(summary["dcp_over_meshtrain"])
    return "\n".join([
        table(("reader", "median s", "min s", "max s", "peak RSS added MiB"), rows),
        f"dcp / meshtrain, paired per repeat: median {ratios[len(ratios) // 2]:.3f} "
        f"(min {ratios[0]:.3f}, max {ratios[-1]:.3f}); the same values on every rank: "
        f"{summary['same_values']}"])


def bench_export(args, folder: Path, base: Path) -> dict:
    """meshtrain's shard writer against DCP's HuggingFaceStorageWriter, one process."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    from meshtrain.checkpoint.hf_export import _write_shards
    from meshtrain.checkpoint.hf_weights import weight_files

    files = weight_files(folder)
    state = {}
    for name, file in files.items():
        state.setdefault(file, load_file(file))
    state = {n: t for shard in state.values() for n, t in shard.items()}
    max_bytes = args.shard_mb * 10**6
    index, size, number = {}, 0, 1  # DCP's writer told the same split as meshtrain's
    for name, t in state.items():
        if index and size + t.numel() * t.element_size() > max_bytes:
            number, size = number + 1, 0
        index[name] = number
        size += t.numel() * t.element_size()

    def write(method: str, out: Path) -> None:
        out.mkdir(parents=True)
        if method == "meshtrain":
            _write_shards(state, out, max_bytes)
        else:
            torch.distributed.checkpoint.save(
                state, storage_writer=HuggingFaceStorageWriter(str(out), index),
                no_dist=True)

    rows = []
    for rep in range(args.repeats):
        row = {}
        turn = rep % len(METHODS)
        for method in METHODS[turn:] + METHODS[:turn]:
            out = base / f"out-{method}-{rep}"
            start = time.perf_counter()
            write(method, out)
            row[f"{method}_s"] = time.perf_counter() - start
            back = {n: t for f in out.glob("*.safetensors") for n, t in load_file(f).items()}
            row[f"{method}_files"] = len(list(out.glob("*.safetensors")))
            assert back.keys() == state.keys() and all(torch.equal(back[n], state[n])
                                                       for n in state), method
            shutil.rmtree(out)
        rows.append(row)
    out = {k: spread(row[k] for row in rows) for k in rows[0] if k.endswith("_s")}
    out["dcp_over_meshtrain"] = [row["dcp_s"] / row["meshtrain_s"] for row in rows]
    out["files"] = {m: rows[0][f"{m}_files"] for m in METHODS}
    out["per_repeat"] = rows
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layout", choices=("zero3", "tp"), default="zero3")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--shard-mb", type=int, default=200)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--export", action="store_true")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    base = Path(tempfile.mkdtemp(prefix="meshtrain-hfw-"))
    try:
        folder = base / "llama"
        params = write_folder(args, folder)
        print(f"hf weights benchmark: Llama {params / 1e6:.1f}M parameters "
              f"({params * 4 / 2**20:.0f} MiB fp32) in {len(list(folder.glob('*.safetensors')))}"
              f" files, {args.layout} on {args.world_size} ranks, {args.repeats} repeats",
              flush=True)
        if args.export:
            summary = bench_export(args, folder, base)
            ratios = sorted(summary["dcp_over_meshtrain"])
            print(table(("writer", "median s", "min s", "max s"), [
                (m, *(f"{summary[f'{m}_s'][k]:.3f}" for k in ("median", "min", "max")))
                for m in METHODS]))
            print(f"dcp / meshtrain, paired per repeat: median {ratios[len(ratios) // 2]:.3f} "
                  f"(min {ratios[0]:.3f}, max {ratios[-1]:.3f}); files {summary['files']}")
            if args.out:
                write_json(args.out, {"machine": machine(), "params": params, **summary})
            return 0
        cfg = {"layout": args.layout, "repeats": args.repeats, "timeout": args.timeout}
        start = time.perf_counter()
        ranks = run_workers(bench_worker, args.world_size, (cfg, str(folder)),
                            timeout=args.timeout, threads=1)
        summary = summarize(ranks)
        print(f"(ran in {time.perf_counter() - start:.0f} s)\n")
        print(format_table(summary))
        if args.out:
            write_json(args.out, {"machine": machine(), "args": {k: str(v) for k, v in
                                                                  vars(args).items()},
                                  "params": params, **summary})
            print(f"\nwrote {args.out}")
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
