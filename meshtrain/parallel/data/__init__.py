"""Data parallelism: DDP and its comm hooks, ZeRO-1, FSDP2 sharding (ZeRO-2/3, HSDP) and its
gloo collectives, local SGD, synchronised BatchNorm, batch-wide gathers."""
