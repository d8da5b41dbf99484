"""Peak memory per rank of context parallel as the sequence grows and ``cp`` rises.

``attention`` (the default): one attention layer's forward and backward (batch 1, 4 heads of
64, float32, causal) on each of ``cp`` CPU processes (gloo, one torch thread each), each holding
its zig-zag share of the tokens, through ``cp_attention`` (ring attention,
parallel/context/ring.py); ``cp=1`` is torch's own fused causal attention on the whole sequence.

``gpt``: one training step's forward and backward of meshtrain's GPT (2 layers, d_model 128, 2
heads of 64, vocabulary 256, batch 1, float32) on the whole sequence (``cp=1``) or on each
rank's share of it (``GPT.enable_context_parallel``, the batch cut by ``shard_batch``); the
parameters and their gradients exist before the measured step (a first step ran, its gradients
zeroed in place), so what is measured is the step's activations and transients.

The peak is the resident-memory high-water mark above the start (``PeakRSS``), the largest over
the ranks, with the ratio to ``cp=1``'s; ``tensors`` the peak of live tensor bytes above the
start (``TensorPeak``, a second run of the same step); the wall time and the CPU time of the
step (``process_time``: what the rank computed, without waiting), each the slower rank's, of
the ``PeakRSS`` run.

    python benchmarks/cp_memory.py                             # attention: 16k, 32k; cp 1, 2, 4
    python benchmarks/cp_memory.py --what gpt                  # a GPT step: 16k, 32k; cp 1, 2, 4
    python benchmarks/cp_memory.py --lengths 2048 --cps 1 2    # smoke run
"""

from __future__ import annotations

import argparse
import time

import harness
import torch

HEADS, DIM = 4, 64
GPT = dict(vocab_size=256, num_layers=2, num_heads=2, d_model=128)


def _attention(length: int, mesh):
    """The step of the ``attention`` benchmark on ``length // cp`` tokens (after a warm-up)."""
    from meshtrain.parallel.context.context_parallel import cp_attention

    gen = torch.Generator().manual_seed(0)

    def tensors(n):
        return [torch.randn(1, HEADS, n, DIM, generator=gen, requires_grad=True)
                for _ in range(3)]

    def run(n):
        cp_attention(*tensors(n), mesh).sum().backward()

    local = length // (mesh.size() if mesh is not None else 1)
    run(min(local, 256))  # the first call's one-time costs (gloo buffers, kernels)
    return lambda: run(local)  # (the inputs made inside: counted, as in one process)


def _gpt(length: int, mesh):
    """The step of the ``gpt`` benchmark: this rank's share of one ``length``-token sequence."""
    from meshtrain.models.gpt import GPT as Model
    from meshtrain.models.gpt import GPTConfig
    from meshtrain.parallel.context.context_parallel import shard_batch

    model = Model(GPTConfig(seq_len=length, **GPT))
    if mesh is not None:
        model.enable_context_parallel(mesh)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, GPT["vocab_size"], (1, length + 1), generator=gen)

    def step(n=length):
        batch = (tokens[:, :n], tokens[:, 1:n + 1])
        inputs, targets = shard_batch(batch, mesh) if mesh is not None else batch
        logits = model(inputs)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()

    step(256)  # gradients allocated, kernels warm (a short sequence: its pages are not the step's)
    for p in model.parameters():
        p.grad.zero_()
    return step


def _rank(what: str, length: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from meshtrain.observe.memory.peak_rss import PeakRSS
    from meshtrain.observe.memory.tensor_peak import TensorPeak

    torch.set_num_threads(1)
    harness.init_gloo(1200)
    world = torch.distributed.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",)) if world > 1 else None
    step = (_gpt if what == "gpt" else _attention)(length, mesh)
    result = {}
    for name, meter in (("peak_mib", PeakRSS), ("tensors_mib", TensorPeak)):
        torch.distributed.barrier()
        with meter() as peak:
            start, cpu = time.perf_counter(), time.process_time()
            step()
            seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
        result[name] = peak.bytes / 2**20
        result.setdefault("seconds", seconds)
        result.setdefault("cpu_seconds", cpu)
    harness.end_process_group()
    return result


def measure(what: str, length: int, cp: int) -> dict:
    from meshtrain.launch.spawn import run_workers

    ranks = run_workers(_rank, cp, (what, length), timeout=2400)
    return {key: max(r[key] for r in ranks)
            for key in ("peak_mib", "tensors_mib", "seconds", "cpu_seconds")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--what", choices=("attention", "gpt"), default="attention")
    parser.add_argument("--lengths", type=int, nargs="+", default=[16384, 32768])
    parser.add_argument("--cps", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    header = ["tokens", "cp", "peak MiB/rank", "x cp=1", "tensors MiB", "x cp=1", "s", "cpu s"]
    rows, results = [], []
    for length in args.lengths:
        base = None
        for cp in args.cps:
            r = measure(args.what, length, cp)
            base = r if cp == 1 else base
            results.append({"what": args.what, "tokens": length, "cp": cp, **r})

            def ratio(key):
                return harness.fmt(r[key] / base[key], ".2f") if base else "-"

            rows.append([str(length), str(cp), harness.fmt(r["peak_mib"], ".0f"),
                         ratio("peak_mib"), harness.fmt(r["tensors_mib"], ".0f"),
                         ratio("tensors_mib"), harness.fmt(r["seconds"], ".2f"),
                         harness.fmt(r["cpu_seconds"], ".2f")])
            print(harness.table(header, rows[-1:]), flush=True)
    print(harness.table(header, rows))
    if args.out:
        harness.write_json(args.out, harness.machine(results=results))


if __name__ == "__main__":
    main()
