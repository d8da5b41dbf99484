"""Memory per rank: model-state bytes measured (probe) and predicted (ZeRO formulas), and the peaks
of a stretch of code on CPU (resident memory, live tensors)."""
