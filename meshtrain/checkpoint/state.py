"""Saving and loading training state with torch distributed checkpoint (DCP).

Every rank writes its own part in parallel, and a checkpoint saved on one world size loads on
another. A checkpoint is a folder::

    step_000200/
        .metadata, __0_0.distcp, ...   model and optimizer (DCP)
        trainer_state.pt               step, epoch, data position, scheduler, grad scaler
        rng_rank{r}.pt                 each rank's random number generator states
        meshtrain.json                 human-readable summary (step, layout, metrics)

Every file holds plain data only and is read back without running code (``safe_load.py``).

The folder is written under a temporary name and renamed when every rank has finished, so a
half-written checkpoint is never mistaken for a complete one.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

from meshtrain.checkpoint.safe_load import check_plain, load_dcp, load_plain, read_metadata
from meshtrain.errors import ConfigError
from meshtrain.parallel.data.zero1 import (
    load_zero1_state_dict,
    zero1_state_dict,
    zero1_state_dict_template,
)

TRAINER_STATE = "trainer_state.pt"
SUMMARY = "meshtrain.json"


@contextlib.contextmanager
def _quiet_single_process():
    """DCP warns that it assumes one process when there is no process group: that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*single process")
        yield


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def rng_state() -> dict:
    """This process's random number generator states as plain data (tensors, numbers, strings:
    ``load_plain`` reads them back without unpickling objects)."""
    version, internal, gauss = random.getstate()
    numpy = np.random.get_state(legacy=False)
    state = {
        "torch": torch.get_rng_state(),
        "python": [version, list(internal), gauss],
        "numpy": {"bit_generator": numpy["bit_generator"],
                  "key": torch.from_numpy(numpy["state"]["key"].astype(np.int64)),
                  "pos": int(numpy["state"]["pos"]), "has_gauss": int(numpy["has_gauss"]),
                  "gauss": float(numpy["gauss"])},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    numpy = state["numpy"]
    np.random.set_state({"bit_generator": numpy["bit_generator"],
                         "state": {"key": numpy["key"].numpy().astype(np.uint32),
                                   "pos": numpy["pos"]},
                         "has_gauss": numpy["has_gauss"], "gauss": numpy["gauss"]})
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _state(model, optimizer, *, for_load: bool) -> dict:
    """What DCP saves or fills: model and optimizer state keyed by parameter names.

    ZeRO-1's optimizer is not understood by ``get_state_dict``; each rank then gives the
    entries of the parameters it owns, in the same format, so checkpoints stay interchangeable.
    """
    if optimizer is None:
        return {"model": get_state_dict(model, [])[0]}
    if _on_servers(optimizer):  # ps: the servers' parameters and state, copied in first
        if not for_load:
            optimizer.fetch()
        optimizer = optimizer.local
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        model_sd = get_state_dict(model, [])[0]
        optim_sd = (zero1_state_dict_template if for_load else zero1_state_dict)(model, optimizer)
        return {"model": model_sd, "optim": optim_sd}
    model_sd, optim_sd = get_state_dict(model, optimizer)
    from meshtrain.parallel.expert.apply import optim_state_as_dtensors

    optim_state_as_dtensors(model, optim_sd)  # ep's experts: saved whole, loaded as rows
    return {"model": model_sd, "optim": optim_sd}


def _on_servers(optimizer) -> bool:
    """A ps layout's optimizer (meshtrain/parallel/ps/layout.py), whose state is on servers."""
    return hasattr(optimizer, "fetch") and hasattr(optimizer, "local")


def tmp_path(path: str | os.PathLike) -> Path:
    """Where the checkpoint for ``path`` is written before it is renamed: ``.tmp-<name>``."""
    path = Path(path)
    return path.with_name(f".tmp-{path.name}")


def prepare_tmp(tmp: Path, agree: bool = True) -> None:
    """Collective: rank 0 empties and creates ``tmp``; every rank then may write into it.
    ``agree=False``: no barrier (the caller's agreement that it worked is one)."""
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    if agree:
        _barrier()


def write_extras(tmp: Path, trainer_state: dict, summary: dict) -> None:
    """This rank's RNG states; on rank 0 also the trainer state and the summary. No collective.
    Refuses (before writing) a trainer state that is more than plain data (:func:`check_plain`)."""
    if _rank() == 0:
        check_plain(trainer_state, "the trainer state")
    torch.save(rng_state(), tmp / f"rng_rank{_rank()}.pt")
    if _rank() == 0:
        torch.save(trainer_state, tmp / TRAINER_STATE)
        (tmp / SUMMARY).write_text(json.dumps(summary, indent=2, default=str))


def checkpoint_state(model, optimizer) -> dict:
    """The dict DCP saves: model and optimizer state keyed by parameter names.

    Collective when a process group exists (call it on every rank, as saving is)."""
    state = _state(model, optimizer, for_load=False)
    _list_every_rank_params(state.get("optim"))
    return state


def _list_every_rank_params(optim_sd: dict | None) -> None:
    """Make each param group list the parameter names of every rank, not only this one's.

    DCP stores ``param_groups`` once (the ranks' copies share one key), so under pipeline
    parallelism, where each rank holds other parameters, the checkpoint would list only one
    stage's names; a rank that then finds none of its own parameters in a saved group gets a
    group without hyperparameters (``KeyError: 'betas'`` at the next step)."""
    if not optim_sd or not dist.is_initialized() or dist.get_world_size() == 1:
        return
    groups = optim_sd.get("param_groups", [])
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, [list(g.get("params", [])) for g in groups])
    for i, group in enumerate(groups):
        names = list(group.get("params", []))
        seen = set(names)
        for rank_groups in everyone:
            for name in rank_groups[i] if i < len(rank_groups) else ():
                if name not in seen:
                    seen.add(name)
                    names.append(name)
        group["params"] = names


def commit_tmp(tmp: Path, path: Path) -> None:
    """Rank 0 replaces ``path`` with the fully written ``tmp`` (no collective)."""
    if _rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)


def load_checkpoint(
    path: str | os.PathLike,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    extra: dict | None = None,
) -> dict:
    """Collective: load model (and optimizer) in place; return the trainer state dict.
    ``extra``: {name: state} of callbacks, loaded in place where the checkpoint has them (the
    names it lacks are removed from ``extra``)."""
    path = Path(path)
    if not (path / TRAINER_STATE).exists():
        raise ConfigError(
            f"{path} is not a complete meshtrain checkpoint (no {TRAINER_STATE}); pass the folder "
            "of a checkpoint such as runs/<name>/<time>/checkpoints/final"
        )
    state = _state(model, optimizer, for_load=True)
    if extra:
        saved = {key.split(".")[1] for key in read_metadata(path).state_dict_metadata
                 if key.startswith("callbacks.")}
        for name in set(extra) - saved:
            del extra[name]
        if extra:
            state["callbacks"] = extra
    with _quiet_single_process():
        load_dcp(state, path)
    servers, optimizer = (optimizer, optimizer.local) if _on_servers(optimizer) else (
        None, optimizer)
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        set_state_dict(model, [], model_state_dict=state["model"], optim_state_dict={},
                       options=StateDictOptions(strict=True))
        load_zero1_state_dict(model, optimizer, state["optim"])
    else:
        from meshtrain.parallel.expert.apply import optim_state_as_local

        optim_state_as_local(model, state.get("optim", {}))
        set_state_dict(
            model,
            optimizer if optimizer is not None else [],
            model_state_dict=state["model"],
            optim_state_dict=state.get("optim", {}),
            options=StateDictOptions(strict=True),
        )
    if servers is not None:  # ps: the loaded state goes to the servers
        servers.restore()
    rng_file = path / f"rng_rank{_rank()}.pt"
    if rng_file.exists():
        set_rng_state(load_plain(rng_file))
    return load_plain(path / TRAINER_STATE)


def load_model_weights(path: str | os.PathLike, model: torch.nn.Module) -> None:
    """Load only the model part of a checkpoint into a plain module, no process group needed."""
    load_checkpoint(path, model, None)
