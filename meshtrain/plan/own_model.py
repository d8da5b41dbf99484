"""A user's own model as the planner sees it (``layout="auto"`` for a model that is neither
meshtrain's GPT nor a Hugging Face causal LM): the job's own model, batch and loss, probed on
the meta device with hooks at its blocks' boundaries, instead of a config the planner could
rebuild at other depths.

    spec = OwnModelSpec.from_model(meta_model, example_batch, loss_fn)

What it plans: data parallelism in every form (dp, zero1/2/3, HSDP) and, for a model whose
blocks a pipeline can cut (``model.layers`` or an ``nn.Sequential``), pp. Not tensor or context
parallelism: those need the model's heads and sequence, which only its own plans know (pin
them with a concrete layout instead). The per-sample figures come from one forward and
backward of the whole model at micro-batch 1 (``probe.probe_own``); a block is the average of
the model's repeated blocks (``fully_shard.find_blocks``, or the pipeline's).
"""

from __future__ import annotations

import copy
import dataclasses

import torch
from torch.utils._pytree import tree_map

from meshtrain.errors import ConfigError
from meshtrain.plan.model_spec import ModelSpec

#: What an own model's spec says for the LM facts it has none of (heads: tp is not planned).
NO_SEQUENCE = 1


@dataclasses.dataclass(frozen=True, eq=False)
class OwnModelSpec(ModelSpec):
    meta_model: torch.nn.Module | None = None  # the job's model on the meta device
    example: object = None  # one sample as the loader batches it (micro-batch 1), on meta
    loss_fn: object = None  # the job's loss_fn (None: the model returns its loss)
    pipelines: bool = False  # can a pipeline cut its blocks (model.layers / nn.Sequential)?

    own = True

    @classmethod
    def from_model(cls, meta_model: torch.nn.Module, example, loss_fn) -> OwnModelSpec:
        """From the job's model on meta, one batch of its data (any batch size: its first
        sample is kept) and its loss_fn."""
        if example is None:
            raise ConfigError(
                f'layout="auto" probes {type(meta_model).__name__} with a sample of the '
                "training data, and none could be read (a dataset of (inputs, targets) or dict "
                "samples, indexable or iterable); give a layout")
        example = tree_map(lambda t: t[:1].to("meta") if isinstance(t, torch.Tensor) else t,
                           example)
        blocks = own_blocks(meta_model)
        try:
            from meshtrain.parallel.pipeline import pipeline_blocks

            pipelines = len(pipeline_blocks(meta_model)) >= 2
        except ConfigError:
            pipelines = False
        spec = cls(type(meta_model).__name__, None, len(blocks), 1, 1, 0, 0, 1 << 30,
                   meta_model=meta_model, example=example, loss_fn=loss_fn,
                   pipelines=pipelines)
        from meshtrain.plan.probe import probe_own

        try:
            probe = probe_own(spec, torch.float32)
        except Exception as error:  # noqa: BLE001 -- what cannot run on meta, said
            raise ConfigError(
                f'layout="auto" could not probe {type(meta_model).__name__} on the meta device '
                f"(one forward and backward of a sample, to size its activations): {error}. "
                "Give a layout (e.g. layout=\"zero2=4\")") from None
        # what a pipeline sends between stages: the widest block input of one sample
        width = probe.block.inputs // 4 if probe.block.inputs else 0
        return dataclasses.replace(spec, hidden=max(1, width))

    # -- what the planner asks of a spec ----------------------------------------------------------
    @property
    def is_hf(self) -> bool:
        return False

    @property
    def num_experts(self) -> int:
        return 0

    def refuses(self, axis: str) -> str | None:
        """Why ``axis`` is not planned for this model (None: it is)."""
        if axis in ("tp", "cp"):
            return (f"{axis}: layout=\"auto\" plans data parallelism and pp for a model of "
                    f"its own ({self.name}); for {axis} give a layout")
        if axis == "pp" and not self.pipelines:
            return (f"pp: {self.name} has no blocks a pipeline can cut (model.layers, an "
                    "nn.ModuleList, or an nn.Sequential)")
        return None

    def block_bytes(self, experts_only: bool = False) -> int:
        """A block's parameter bytes, the average of the model's blocks."""
        if experts_only:
            return 0
        blocks = own_blocks(self.meta_model)
        total = sum(p.numel() * p.element_size() for b in blocks for p in b.parameters())
        return total // max(1, len(blocks))

    def build(self, num_layers: int | None = None) -> torch.nn.Module:
        """The model at its own depth: a copy on meta under ``torch.device("meta")``, else
        allocated on the default device with small random values (for timing runs)."""
        assert num_layers in (None, self.num_layers), "an own model is probed whole"
        model = copy.deepcopy(self.meta_model)
        device = torch.get_default_device()
        if device.type != "meta":
            model.to_empty(device=device)
            with torch.no_grad():
                for tensor in (*model.parameters(), *model.buffers()):
                    if tensor.is_floating_point():
                        tensor.uniform_(-0.01, 0.01)
                    else:
                        tensor.zero_()
        return model

    def blocks(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        return own_blocks(model)

    def batch(self, size: int, seq_len: int | None = None, device="cpu"):
        """``size`` copies of the example sample on ``device`` (zeros: values do not matter)."""
        return tree_map(lambda t: torch.zeros((size, *t.shape[1:]), dtype=t.dtype, device=device)
                        if isinstance(t, torch.Tensor) else t, self.example)

    def loss(self, model: torch.nn.Module, batch) -> torch.Tensor:
        from meshtrain.parallel.step_loss import compute_loss

        return compute_loss(model, batch, self.loss_fn)


def own_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks the planner prices one by one: the pipeline's where a pipeline can
    cut the model, else FSDP's (``find_blocks``), else the whole model as one."""
    from meshtrain.parallel.data.fully_shard import find_blocks
    from meshtrain.parallel.pipeline import pipeline_blocks

    try:
        blocks = pipeline_blocks(model)
    except ConfigError:
        blocks = []
    if len(blocks) < 2:
        blocks = find_blocks(model)
    return blocks or [model]
