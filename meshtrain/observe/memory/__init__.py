"""Memory per rank: model-state bytes measured (probe) and predicted (ZeRO formulas), and the peaks
of a stretch of code on CPU (resident memory, live tensors)."""

from meshtrain._graveyard import moved_names

# what this path held as a module: now in probe.py, read from here with a DeprecationWarning
__getattr__ = moved_names(__name__, "meshtrain.observe.memory.probe", [
    "ForwardParamBytes", "MIB", "MemoryProbe", "MemoryRow", "allocator_bytes",
    "format_memory_table", "memory_row", "memory_summary", "model_state_bytes"])
