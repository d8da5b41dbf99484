"""Models meshtrain ships, importable from here: its GPT (``GPT(GPTConfig(...))``; a mixture of
experts with ``GPTConfig.num_experts``, docs/moe.md) and, for Hugging Face ``transformers``
models (extra ``meshtrain[hf]``), ``HFCausalLM`` (a factory that builds one module by module,
sharded from the start; docs/sharding.md) and ``tiny_causal_lm``. They are imported on first
use (torch and transformers are not imported with this package).
"""

from typing import TYPE_CHECKING

from meshtrain._lazy import lazy_exports

_EXPORTS = {"GPT": "meshtrain.models.gpt", "GPTConfig": "meshtrain.models.gpt",
            "HFCausalLM": "meshtrain.models.hf.init", "tiny_causal_lm": "meshtrain.models.hf"}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:  # what the names are, for type checkers and editors
    from meshtrain.models.gpt import GPT, GPTConfig
    from meshtrain.models.hf import tiny_causal_lm
    from meshtrain.models.hf.init import HFCausalLM
