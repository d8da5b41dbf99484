"""Context parallelism: each sequence split over ranks, keys and values passed around them
(ring attention).

What a model's own ``enable_context_parallel(cp_mesh)`` uses, importable from here
(docs/model_parallel.md, meshtrain's GPT does the same): :func:`cp_attention` (causal attention
of this rank's queries over the whole sequence), :func:`local_positions` (the global positions
of this rank's tokens), the split itself (:func:`shard_sequence`, :func:`unshard_sequence`,
:func:`chunk_order`) and :func:`check_cp` (a sequence length cp can split). They are imported
on first use (torch is not imported with this package).
"""

from typing import TYPE_CHECKING

from meshtrain._lazy import lazy_exports

_CP = "meshtrain.parallel.context.context_parallel"
_EXPORTS = {name: _CP for name in ("check_cp", "chunk_order", "cp_attention", "local_positions",
                                   "shard_sequence", "unshard_sequence")}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:  # what the names are, for type checkers and editors
    from meshtrain.parallel.context.context_parallel import (
        check_cp, chunk_order, cp_attention, local_positions, shard_sequence, unshard_sequence,
    )
