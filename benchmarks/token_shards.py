"""Opening and reading memory-mapped token shards (meshtrain.data.tokens.PackedTokens) at
~20 MB, ~200 MB and ~2 GB, to show that neither cost grows with the corpus.

For each size a shard set of random uint16 tokens (vocabulary 50257, documents of 1 to 8191
tokens, default 100M-token = 200 MB shards) is written with ``TokenShardWriter`` into a temporary
folder under /tmp (deleted afterwards). The files are then dropped from the page cache
(``posix_fadvise(DONTNEED)``) and a fresh Python process measures:

* ``open``: ``PackedTokens(folder, seq_len)`` (reads meta.json, stats the shard files);
* ``first sample``: the first ``ds[i]`` (maps the shard, reads from disk);
* ``cold read``: mean time of ``ds[i]`` over ``--samples`` random indices, files not cached;
* ``warm read``: the same indices again (now in the page cache);
* ``warm dict+pos``: the same with ``dict_batches=True, document_positions=True``.

    python benchmarks/token_shards.py                      # 20 MB, 200 MB, 2 GB; 20k samples
    python benchmarks/token_shards.py --sizes-mb 20 --samples 2000   # smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from harness import WallClock, machine, table, write_json

from meshtrain.data.tokens import TokenShardWriter

VOCAB, EOS = 50257, 50256

MEASURE = r"""
import json, sys, time
import numpy as np
t0 = time.perf_counter()
from meshtrain.data.tokens import PackedTokens
folder, seq_len, samples = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
t1 = time.perf_counter()
ds = PackedTokens(folder, seq_len)
t2 = time.perf_counter()
idx = np.random.default_rng(0).integers(0, len(ds), size=samples + 1).tolist()
ds[idx[-1]]
t3 = time.perf_counter()
def mean(d):
    start = time.perf_counter()
    for i in idx[:-1]:
        d[i]
    return (time.perf_counter() - start) / samples
cold = mean(ds)
warm = mean(ds)
dpos = mean(PackedTokens(folder, seq_len, dict_batches=True, document_positions=True))
print(json.dumps({"open_s": t2 - t1, "first_sample_s": t3 - t2, "cold_read_s": cold,
                  "warm_read_s": warm, "warm_dict_pos_s": dpos, "num_samples": len(ds),
                  "num_shards": len(ds.meta["shards"]), "num_docs": ds.meta["num_docs"]}))
"""


def write_set(folder: Path, num_tokens: int, shard_tokens: int, seed: int) -> float:
    """Random documents totalling ``num_tokens`` (eos included); seconds taken."""
    rng = np.random.default_rng(seed)
    start = time.perf_counter()
    written = 0
    with TokenShardWriter(folder, VOCAB, EOS, "random", shard_tokens=shard_tokens) as writer:
        while written < num_tokens:
            chunk = rng.integers(0, EOS, size=min(1 << 24, num_tokens - written + 1),
                                 dtype=np.uint16)
            lengths = rng.integers(1, 8192, size=len(chunk) // 1024 + 2)
            cuts = np.cumsum(lengths)
            for doc in np.split(chunk, cuts[cuts < len(chunk)]):
                if written >= num_tokens:
                    break
                doc = doc[: max(0, num_tokens - written - 1)]
                writer.add_document(doc)
                written += len(doc) + 1
    return time.perf_counter() - start


def drop_cache(folder: Path) -> None:
    for path in folder.iterdir():
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[20, 200, 2000])
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--samples", type=int, default=20_000)
    parser.add_argument("--shard-tokens", type=int, default=100_000_000)
    parser.add_argument("--tmp", default="/tmp")
    parser.add_argument("--out", default="benchmarks/results/token_shards.json")
    args = parser.parse_args()
    clock = WallClock()
    repo = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": repo + os.pathsep + os.environ.get("PYTHONPATH", "")}
    rows, results = [], []
    for size_mb in args.sizes_mb:
        tmp = Path(tempfile.mkdtemp(prefix="token_shards_", dir=args.tmp))
        try:
            folder = tmp / "train"
            write_s = write_set(folder, size_mb * 1_000_000 // 2, args.shard_tokens, size_mb)
            disk = sum(p.stat().st_size for p in folder.iterdir())
            drop_cache(folder)
            proc = subprocess.run([sys.executable, "-c", MEASURE, str(folder), str(args.seq_len),
                                   str(args.samples)], env=env, capture_output=True, text=True,
                                  check=True)
            r = {"size_mb": size_mb, "disk_bytes": disk, "write_s": write_s,
                 **json.loads(proc.stdout.strip().splitlines()[-1])}
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        results.append(r)
        rows.append((f"{disk / 1e6:,.0f} MB", f"{r['num_shards']}", f"{r['num_samples']:,}",
                     f"{r['write_s']:.1f}", f"{r['open_s'] * 1e3:.2f}",
                     f"{r['first_sample_s'] * 1e3:.2f}", f"{r['cold_read_s'] * 1e6:.1f}",
                     f"{r['warm_read_s'] * 1e6:.1f}", f"{r['warm_dict_pos_s'] * 1e6:.1f}"))
        print(f"done {size_mb} MB", file=sys.stderr)
    print(f"seq_len {args.seq_len}, {args.samples:,} random samples, uint16 tokens")
    print(table(["shard set", "shards", "samples", "write s", "open ms", "first sample ms",
                 "cold read us", "warm read us", "warm dict+pos us"], rows))
    print(clock.stop())
    result = {"machine": machine(), **clock.loads(), "wall_s": clock.wall_s,
              "seq_len": args.seq_len, "samples": args.samples, "results": results}
    print(f"wrote {write_json(args.out, result)}")


if __name__ == "__main__":
    main()
