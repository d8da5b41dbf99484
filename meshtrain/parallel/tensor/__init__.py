"""Tensor parallelism: Megatron splits on DTensor, sequence parallel, the pre-start shape check
and the first steps' plan checks."""
