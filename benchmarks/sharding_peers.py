"""The peers of sharding.py: the same ZeRO-3 job written as a user of another tool would write it.

* ``fsdp2-raw``: a hand-written loop: ``init_process_group("gloo")``, ``fully_shard`` on each
  ``Linear`` and on the root (FSDP2's defaults: ZeRO-3), a ``DataLoader`` over a
  ``DistributedSampler``, and per batch forward, ``mse_loss``, ``backward()``, ``step()``,
  ``zero_grad()``.
* ``lightning-fsdp2``: Lightning's ``ModelParallelStrategy(data_parallel_size=2,
  tensor_parallel_size=1)`` with the same ``fully_shard`` calls in ``configure_model`` (its
  documented FSDP2 recipe), progress bar, logger, checkpointing, summary and sanity checks off.

Not run, with the reason printed (both only work on GPUs):

* Lightning's ``FSDPStrategy`` (FSDP1) refuses ``accelerator="cpu"``: "The strategy `fsdp`
  requires a GPU accelerator" (Lightning 2.6.6).
* Accelerate's FSDP2 plugin (``FullyShardedDataParallelPlugin(fsdp_version=2)``) is taken only
  for GPU-like devices; on CPU (``DistributedType.MULTI_CPU``) Accelerate 1.15 ignores it and
  wraps the model in DDP (``accelerate/state.py``), so its row would time DDP, not FSDP2.

Each worker stamps the end of every optimizer step, as sharding.py's layouts do.
"""

from __future__ import annotations

import os
import tempfile
import time

import torch
import torch.nn.functional as F
from harness import drain_collectives, lightning_as_torchrun_worker
from torch.utils.data import DataLoader

PEERS = ("fsdp2-raw", "lightning-fsdp2")
NOT_RUN = {
    "lightning-fsdp1": "Lightning's FSDPStrategy refuses accelerator='cpu' (it requires a GPU)",
    "accelerate-fsdp2": ("Accelerate takes its FSDP plugin only on GPU-like devices; on CPU it "
                         "wraps the model in DDP instead"),
}


def available(peer: str) -> str | None:
    """None if ``peer`` can run here, else why not."""
    if peer == "lightning-fsdp2":
        try:
            import lightning  # noqa: F401
        except ImportError:
            return "lightning is not installed (pip install -e '.[bench]')"
    return None


def _shard(model: torch.nn.Module, mesh=None) -> None:
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def _result(ends: list[float], cfg) -> dict:
    if len(ends) != cfg.total_steps:
        raise RuntimeError(f"saw {len(ends)} step ends, expected {cfg.total_steps}")
    return {"rank": int(os.environ.get("RANK", 0)),
            "step_s": (ends[-1] - ends[cfg.warmup - 1]) / cfg.steps}


def fsdp2_raw_worker(cfg, build_model, build_data) -> dict:
    import torch.distributed as dist
    from torch.utils.data.distributed import DistributedSampler

    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"  # join run_workers' store, as torchrun
    dist.init_process_group("gloo")
    torch.manual_seed(cfg.seed)
    model = build_model(cfg)
    _shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    dataset = build_data(cfg)
    sampler = DistributedSampler(dataset, shuffle=True, seed=cfg.seed, drop_last=True)
    loader = DataLoader(dataset, batch_size=cfg.global_batch_size // dist.get_world_size(),
                        sampler=sampler, drop_last=True)
    ends = []
    for inputs, targets in loader:
        F.mse_loss(model(inputs), targets).backward()
        optimizer.step()
        optimizer.zero_grad()
        ends.append(time.perf_counter())
        if len(ends) == cfg.total_steps:
            break
    drain_collectives()
    dist.destroy_process_group()
    return _result(ends, cfg)


def lightning_fsdp2_worker(cfg, build_model, build_data) -> dict:
    L = lightning_as_torchrun_worker("meshtrain-sharding-bench")
    from lightning.pytorch.strategies import ModelParallelStrategy

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(cfg.seed)
            self.net = build_model(cfg)

        def configure_model(self):
            _shard(self.net, self.device_mesh["data_parallel"])

        def training_step(self, batch, batch_idx):
            inputs, targets = batch
            return F.mse_loss(self.net(inputs), targets)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=cfg.lr)

    ends: list[float] = []

    class Clock(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            ends.append(time.perf_counter())

    world = int(os.environ["WORLD_SIZE"])
    loader = DataLoader(build_data(cfg), batch_size=cfg.global_batch_size // world,
                        shuffle=True, drop_last=True)
    with tempfile.TemporaryDirectory(prefix="lightning-sharding-") as root:
        trainer = L.Trainer(
            accelerator="cpu", devices=world,
            strategy=ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1),
            max_steps=cfg.total_steps, enable_progress_bar=False, logger=False,
            enable_checkpointing=False, enable_model_summary=False, num_sanity_val_steps=0,
            callbacks=[Clock()], default_root_dir=root)
        trainer.fit(Module(), loader)
        drain_collectives()
    return _result(ends, cfg)


def peer_worker(peer: str, cfg, build_model, build_data) -> dict:
    worker = {"fsdp2-raw": fsdp2_raw_worker, "lightning-fsdp2": lightning_fsdp2_worker}[peer]
    return worker(cfg, build_model, build_data)
