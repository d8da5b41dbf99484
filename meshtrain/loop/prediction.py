"""``Trainer.predict``: the model's outputs for every sample of a dataset, in the dataset's
order, gathered to global rank 0.

Each rank runs its share of the samples (the evaluation split: every sample once over the
batch ranks); a research module's ``predict_step(batch, batch_idx)`` gives the outputs, else
``model(inputs)`` (the first element of an ``(inputs, targets)`` pair, the batch itself
otherwise). Outputs are cut into one row per sample (a tensor, or a tuple/dict of tensors),
tagged with the sample's index and gathered; tensor-parallel outputs are made whole first, and
of the ranks that hold the same rows (a tp group) only the first sends them; under cp each rank
computes its chunks of every sequence and the outputs of two or more dimensions are gathered
along the sequence (dim 1); under pp the last stage's rank has them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from meshtrain import checks
from meshtrain.data.batch import to_device
from meshtrain.data.sampler import eval_loader
from meshtrain.errors import ConfigError
from meshtrain.loop.state import loader_options


def _whole(out):
    """``out`` with DTensors made whole (collective over their mesh) and moved to the CPU."""
    from torch.distributed.tensor import DTensor

    if isinstance(out, DTensor):
        out = out.full_tensor()
    if isinstance(out, torch.Tensor):
        return out.detach().cpu()
    if isinstance(out, dict):
        return type(out)({k: _whole(v) for k, v in out.items()}) if type(out) is dict else {
            k: _whole(v) for k, v in out.items()}
    if isinstance(out, (tuple, list)):
        return type(out)(_whole(v) for v in out)
    return out


def _row(out, i: int):
    if isinstance(out, torch.Tensor):
        return out[i]
    if isinstance(out, dict):
        return {k: _row(v, i) for k, v in out.items()}
    if isinstance(out, (tuple, list)):
        return type(out)(_row(v, i) for v in out)
    raise ConfigError(f"predict: the model's output is a {type(out).__name__}; return a tensor "
                      "(one row per sample), or a tuple or dict of them")


def _stack(rows: list):
    first = rows[0]
    if isinstance(first, torch.Tensor):
        if all(r.shape == first.shape for r in rows):
            return torch.stack(rows)
        return rows
    if isinstance(first, dict):
        return {k: _stack([r[k] for r in rows]) for k in first}
    if isinstance(first, (tuple, list)):
        return type(first)(_stack([r[i] for r in rows]) for i in range(len(first)))
    return rows


def predict(t, data):
    """See the module's docstring; None on every rank but global rank 0."""
    if t.model is None:
        raise ConfigError("call fit(...) before predict(...)")
    dataset = checks.dataset_of(data, "predict data")
    if not hasattr(dataset, "__len__"):
        raise ConfigError("predict needs a dataset with a length (not a stream): the outputs "
                          "are put back in its order")
    loader = eval_loader(dataset, data, micro_batch_size=t.micro_batch_size, dp_rank=t.dp_rank,
                         dp_degree=t.layout.batch_degree, **loader_options(t))
    # a tp or cp group holds the same rows (cp: gathered over the sequence by the engine)
    sends = all(axis is None or axis.get_local_rank() == 0
                for axis in (t.mesh.axis("tp"), t.mesh.axis("cp")))
    mine = []
    was_training = t.model.training
    t.model.eval()
    try:
        for batch_idx, (indices, batch) in enumerate(zip(loader.batch_sampler, loader)):
            out = t.engine.predict_batch(to_device(batch, t.device), batch_idx)
            if out is None:  # a pipeline rank without the last stage
                continue
            out = _whole(out)
            if sends:
                mine += [(index, _row(out, i)) for i, index in enumerate(indices)]
    finally:
        t.model.train(was_training)
    group = t.mesh.everyone()
    if group is None:
        gathered = [mine]
    else:
        gathered = [None] * dist.get_world_size(group) if t.is_global_zero else None
        dist.gather_object(mine, gathered, group=group, group_dst=0)
    if not t.is_global_zero:
        return None
    rows = dict(pair for part in gathered for pair in part)
    assert sorted(rows) == list(range(len(dataset))), "every sample predicted once"
    return _stack([rows[i] for i in range(len(dataset))])
