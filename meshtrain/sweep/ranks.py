"""What each rank of a trial trains with, as its Trainer and optimizer hold it at the start of
fit, and the check that every rank holds the same: the resolved Trainer settings
(``trainer.hparams()``) and the optimizer's parameter-group values (lr, weight_decay, betas,
...; ``initial_lr`` under a scheduler). The ranks' values are gathered over the run's process
group (meshtrain/sweep/trial.py), so a job whose optimizer factory or config reads the rank
fails its trial with the rank and the value that differ. Each rank's CPU affinity and visible
GPUs go with them: the sweep's record of which slice of the machine the trial ran on."""

from __future__ import annotations

import os

import torch

_SKIP = object()


def _plain(value):
    """A JSON-able, hashable stand-in for a setting or group value; _SKIP for an object."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        items = [_plain(v) for v in value]
        return _SKIP if any(v is _SKIP for v in items) else tuple(items)
    return _SKIP


def optimizer_values(optimizer) -> tuple[int, dict[str, list]]:
    """(number of parameter groups, {key: the distinct values over the groups}) of this rank's
    optimizer (several for a module that optimizes by hand)."""
    optimizers = optimizer if isinstance(optimizer, (list, tuple)) else [optimizer]
    groups = [g for opt in optimizers for g in (getattr(opt, "param_groups", None) or ())]
    values: dict[str, set] = {}
    for group in groups:
        for key, value in group.items():
            value = _plain(value)
            if key != "params" and value is not _SKIP:
                values.setdefault(key, set()).add(value)
    return len(groups), {k: sorted(v, key=repr) for k, v in sorted(values.items())}


def rank_values(trainer) -> dict:
    """This rank's settings, optimizer values and slice of the machine."""
    settings = {k: v for k, v in ((k, _plain(v)) for k, v in trainer.hparams().items())
                if v is not _SKIP}
    num_groups, optimizer = optimizer_values(trainer.optimizer)
    return {"rank": trainer.rank, "settings": settings, "num_groups": num_groups,
            "optimizer": optimizer, "cpus": sorted(os.sched_getaffinity(0)),
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}


def _show(values) -> str:
    values = list(values)
    return repr(values[0]) if len(values) == 1 else repr(values)


def differences(ranks: list[dict]) -> list[str]:
    """Each way a rank's values differ from rank 0's, as 'rank 1's optimizer holds lr = 0.02
    where rank 0's holds 0.01'. Ranks with as many parameter groups as rank 0 must hold the
    same values; a pipeline stage may lack a group (no parameter without weight decay), so
    there only values that neither rank's set contains the other's count."""
    first, said = ranks[0], []
    for other in ranks[1:]:
        who = f"rank {other['rank']}'s"
        for key in sorted(set(first["settings"]) | set(other["settings"])):
            mine, theirs = first["settings"].get(key), other["settings"].get(key)
            if mine != theirs:
                said.append(f"{who} Trainer holds {key} = {theirs!r} where rank "
                            f"{first['rank']}'s holds {mine!r}")
        same_groups = first["num_groups"] == other["num_groups"]
        for key in sorted(set(first["optimizer"]) | set(other["optimizer"])):
            mine = {_hashable(v) for v in first["optimizer"].get(key, [])}
            theirs = {_hashable(v) for v in other["optimizer"].get(key, [])}
            if mine != theirs and (same_groups or not (mine <= theirs or theirs <= mine)):
                said.append(f"{who} optimizer holds {key} = "
                            f"{_show(other['optimizer'].get(key, []))} where rank "
                            f"{first['rank']}'s holds {_show(first['optimizer'].get(key, []))}")
    return said


def _hashable(value):
    return tuple(_hashable(v) for v in value) if isinstance(value, list) else value


def mismatch_message(ranks: list[dict]) -> str | None:
    """The reason a trial whose ranks differ fails, or None when every rank holds the same."""
    said = differences(ranks)
    if not said:
        return None
    return ("the trial's ranks train with different hyperparameters: " + "; ".join(said)
            + ". Every rank must build the same Trainer and optimizer from the trial's values: "
            "does the job's optimizer factory or config depend on the rank?")
