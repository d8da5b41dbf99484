"""Reading what fault_job.py recorded: samples and losses per step, checkpoint contents."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from meshtrain.checkpoint.manager import list_complete
from meshtrain.checkpoint.state import load_model_weights


def steps(run_dir) -> dict[int, dict]:
    """step -> {"samples": sorted global samples of that step over all ranks, "loss": ...}.

    A step that an earlier attempt ran and a later one re-ran (after a restart) counts once,
    as the later attempt ran it: that is the run's real history."""
    by_rank: dict[int, dict[int, dict]] = {}
    files = sorted(Path(run_dir, "samples").glob("rank*_attempt*.jsonl"),
                   key=lambda p: int(re.search(r"attempt(\d+)", p.name).group(1)))
    for path in files:
        rank = int(re.search(r"rank(\d+)", path.name).group(1))
        for line in path.read_text().splitlines():
            record = json.loads(line)
            by_rank.setdefault(rank, {})[record["step"]] = record
    merged: dict[int, dict] = {}
    for records in by_rank.values():
        for step, record in records.items():
            entry = merged.setdefault(step, {"lists": set(), "loss": None})
            # ranks that share data (tensor/pipeline parallel) fetch the same list: count it once
            entry["lists"].add(tuple(record["samples"]))
            if record.get("loss") is not None:
                entry["loss"] = record["loss"]
    return {step: {"samples": sorted(i for lst in entry["lists"] for i in lst),
                   "loss": entry["loss"]} for step, entry in sorted(merged.items())}


def weights(checkpoint, model_fn) -> dict[str, torch.Tensor]:
    model = model_fn()
    load_model_weights(checkpoint, model)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def final_weights(run_dir, model_fn) -> dict[str, torch.Tensor]:
    return weights(Path(run_dir) / "checkpoints" / "final", model_fn)


def assert_equal_weights(a: dict, b: dict, atol: float = 0.0) -> None:
    assert a.keys() == b.keys()
    for name in a:
        if atol == 0.0:
            assert torch.equal(a[name], b[name]), f"{name}: {(a[name] - b[name]).abs().max()}"
        else:
            torch.testing.assert_close(a[name], b[name], atol=atol, rtol=0, msg=name)


def checkpoints_are_finite(run_dir, model_fn) -> list[Path]:
    """Every complete checkpoint of the run, each checked to hold only finite weights."""
    found = list_complete(Path(run_dir) / "checkpoints")
    for path in found:
        for name, value in weights(path, model_fn).items():
            assert torch.isfinite(value).all(), f"{path}: {name} is not finite"
    return found


def attempts(run_dir) -> dict[str, int]:
    """'rank{r}_attempt{a}' -> the step at which that attempt started."""
    return {p.name: int(p.read_text()) for p in Path(run_dir, "attempts").iterdir()}
