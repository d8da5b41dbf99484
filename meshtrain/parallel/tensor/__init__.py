"""Tensor parallelism: Megatron splits on DTensor, sequence parallel, the pre-start shape check
and the first steps' plan checks.

What a plan of your own (``Trainer(tp_plan=...)``, or a model's ``tp_plan`` method) is built
from, importable from here (docs/model_parallel.md): the entries for an attention block and an
MLP (:func:`attention_plan`, :func:`mlp_plan`), the dropouts that must draw on the sequence
shards (:func:`dropout_entries`), and meshtrain's ``ParallelStyle`` classes beside torch's
(``torch.distributed.tensor.parallel.ColwiseParallel``, ...): ``ReplicateParallel`` (a module
left whole, also one that runs on a split activation) and the sequence-parallel styles
``GatherSequenceInput``, ``ColwiseFromSequence``, ``RowwiseToSequence``. They are imported on
first use (torch is not imported with this package).
"""

from typing import TYPE_CHECKING

from meshtrain._lazy import lazy_exports

_TP = "meshtrain.parallel.tensor.tensor_parallel"
_SP = "meshtrain.parallel.tensor.sequence_parallel"
_EXPORTS = {
    "attention_plan": _TP, "mlp_plan": _TP, "dropout_entries": _TP, "ReplicateParallel": _TP,
    "ColwiseFromSequence": _SP, "GatherSequenceInput": _SP, "RowwiseToSequence": _SP,
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:  # what the names are, for type checkers and editors
    from meshtrain.parallel.tensor.sequence_parallel import (
        ColwiseFromSequence, GatherSequenceInput, RowwiseToSequence,
    )
    from meshtrain.parallel.tensor.tensor_parallel import (
        ReplicateParallel, attention_plan, dropout_entries, mlp_plan,
    )
