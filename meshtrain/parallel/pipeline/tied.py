"""Weights tied between the first and the last pipeline stage (an input embedding reused as the
output projection: ``tie_word_embeddings``), Megatron's way.

One process holds one tensor, used twice; its gradient is the sum of both uses. Under ``pp`` the
first stage holds it for the embedding and the last stage a copy for the head, both under the
model's own name for it (the first ``named_parameters`` gives: ``model.embed_tokens.weight``), so
checkpoints and optimizer state are keyed as in one process and either copy loads from them. The
copies start equal (:meth:`TiedWeights.start` sends the last stage's to the first, after the
stages are filled), and after every backward (once data parallelism has averaged them) each
copy's gradient becomes the sum of the two (:meth:`TiedWeights.sum_grads`): the same gradient
and the same optimizer step on both ranks keep them equal. The gradient norm counts the tensor
once (:attr:`TiedWeights.copies`: the last stage's, left out of it).

The two stages are on different ranks in a loop layout (stage 0 on the first pp rank, the last
stage on the last one); the V schedules put both on one rank and are refused with ties
(:func:`check_ties`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from meshtrain.errors import ConfigError
from meshtrain.parallel.data.meta_init import tied_names


def check_ties(model: nn.Module | None, schedule: str) -> None:
    """Refuse, before any process starts, ties that this file cannot keep."""
    from meshtrain.parallel.pipeline.stages import V_SHAPED

    if model is None or schedule not in V_SHAPED:
        return
    ties = tied_names(model)
    if ties:
        raise ConfigError(
            f"pp_schedule={schedule!r} puts the first and the last stage on one rank, and "
            f"{type(model).__name__} ties {' = '.join(ties[0])} between them; use 1f1b, "
            "gpipe or interleaved-1f1b (the tied weight is then kept on the first and last "
            "pp ranks, its gradient summed between them), or untie the weights")


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


class TiedWeights:
    """The copies of the tied weights on this rank's stages, and the ranks they are summed over.

    ``ties``: the whole model's groups of names (:func:`tied_names`); ``stages`` with their
    ``indices`` out of ``num_stages``. Collective: every rank builds it (a group per pair of
    first and last pp ranks when pp > 2)."""

    def __init__(self, ties: list[list[str]], stages: list[nn.Module], indices: list[int],
                 num_stages: int, mesh):
        self.ties, self.stages = ties, stages
        self.ends = [i for i in indices if i in (0, num_stages - 1)]
        assert len(self.ends) <= 1, "first and last stage on one rank (refused by check_ties)"
        self.last = self.ends == [num_stages - 1]
        self.group = self._pair_group(mesh)
        self.params: list[torch.Tensor] = []
        self.copies: set[int] = set()  # ids of the last stage's copies (counted once in norms)

    @staticmethod
    def _pair_group(mesh):
        """The process group of the first and the last pp rank at this rank's coordinates on
        the other axes (the pp group itself when pp = 2; else one group per pair, every rank
        making each, as ``new_group`` needs)."""
        if mesh.layout.degree("pp") == 2:
            return mesh.mesh.get_group("pp")
        names = list(mesh.mesh.mesh_dim_names)
        pp = names.index("pp")
        others = [i for i in range(len(names)) if i != pp]
        rows = mesh.mesh.mesh.permute(*others, pp).reshape(-1, mesh.layout.degree("pp"))
        mine = None
        for row in rows.tolist():
            group = dist.new_group([row[0], row[-1]])
            if dist.get_rank() in (row[0], row[-1]):
                mine = group
        return mine

    def start(self) -> None:
        """Find this rank's copies (after the stages are parallelized and filled) and give the
        first stage the last stage's values (collective over the pipeline's end ranks)."""
        if not self.ends:
            return
        for group in self.ties:
            for stage in self.stages:
                held = dict(stage.named_parameters(remove_duplicate=False))
                found = [held[name] for name in group if name in held]
                if found:
                    assert all(p is found[0] for p in found), f"{group} untied on a stage"
                    assert group[0] in held, f"a stage holds {group} without {group[0]}"
                    self.params.append(found[0])
        assert len(self.params) == len(self.ties), (self.ties, len(self.params))
        if self.last:
            self.copies = {id(p) for p in self.params}
        source = dist.get_global_rank(self.group, dist.get_world_size(self.group) - 1)
        with torch.no_grad():
            for param in self.params:
                dist.broadcast(_local(param), src=source, group=self.group)

    def sum_grads(self) -> None:
        """Each copy's gradient becomes the sum of both (collective over the end ranks)."""
        for param in self.params:
            grad = param.grad
            if grad is None:  # (a step whose loss did not reach it: the sum is the other's)
                param.grad = grad = torch.zeros_like(param)
            dist.all_reduce(_local(grad), group=self.group)
