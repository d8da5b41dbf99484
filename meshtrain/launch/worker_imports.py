"""What a Trainer's worker imports on its way through ``fit``, imported once by run_workers' fork
server (:data:`meshtrain.launch.spawn.FORKSERVER_PRELOAD`) so that no worker imports it again.

The Trainer imports these lazily (``meshtrain --help`` and one-process runs stay quick); a worker
forked from a server that has not imported them spends about a second of its start on them
(torch's optimizers import dynamo, the checkpoint manager DCP, the pipeline runner its
schedules), which on a busy machine is most of a short job. tests/launch/test_fork_server.py
checks that a worker's ``fit`` under each layout imports nothing of meshtrain's or torch's
compiler stack anew. Importing them starts no thread (fork_guard checks at every fork).
"""
# ruff: noqa: F401
import torch._dynamo
import torch.distributed.checkpoint
import torch.distributed.fsdp
import torch.distributed.optim
import torch.distributed.pipelining

import meshtrain.data.stream
import meshtrain.fault.desync
import meshtrain.fault.watchdog
import meshtrain.loop.setup
import meshtrain.loop.step_end
import meshtrain.module.lightning_module
import meshtrain.moe.layer
import meshtrain.moe.pipeline
import meshtrain.moe.tensor_parallel
import meshtrain.observe.loggers
import meshtrain.observe.memory.probe
import meshtrain.observe.model_summary
import meshtrain.observe.progress
import meshtrain.optim
import meshtrain.packing
import meshtrain.launch.waits
import meshtrain.parallel.context.blockwise
import meshtrain.parallel.context.context_parallel
import meshtrain.parallel.context.ring
import meshtrain.parallel.context.sdpa
import meshtrain.parallel.data.data_parallel
import meshtrain.parallel.data.fully_shard
import meshtrain.parallel.data.init_check
import meshtrain.parallel.data.meta_init
import meshtrain.parallel.expert
import meshtrain.parallel.data.local_sgd
import meshtrain.parallel.pipeline.partition
import meshtrain.parallel.pipeline.check
import meshtrain.parallel.pipeline.tied
import meshtrain.parallel.shm.p2p
import meshtrain.parallel.data.sync_batchnorm
import meshtrain.parallel.tensor.tp_debug
import meshtrain.parallel.tensor.tp_shapes
import meshtrain.settings
import meshtrain.trainer  # (`import meshtrain` binds its names lazily)
