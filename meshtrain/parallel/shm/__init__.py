"""Communication through shared memory between CPU processes of one host: send/recv
(``p2p``: pipeline activations and gradients, FSDP's shards) and the tp axis's collectives
(``collectives``), each a c10d backend registered by name."""
