"""Lightning's names for what a Trainer knows, as a LightningModule's code reads them
(``self.trainer.local_rank``, ``self.trainer.optimizers[0]``, ``self.trainer.log_dir``, ...).
Names whose Lightning meaning meshtrain has no counterpart for (``logger``: meshtrain's loggers
are not Lightning's objects) are left out: reading one raises AttributeError."""

from __future__ import annotations

from meshtrain.loop.state import stepping_batches


def _callbacks_of(name: str):
    def found(self) -> list:
        import meshtrain.callbacks as callbacks

        return [c for c in self.callbacks if isinstance(c, getattr(callbacks, name))]
    return property(found)


class LightningViews:
    """Mixed into the Trainer (one process: rank 0 of 1, one device, one node)."""

    # (meshtrain runs no sanity validation before training)
    estimated_stepping_batches, sanity_checking = property(stepping_batches), False
    global_rank = property(lambda self: self.rank)
    local_rank = property(lambda self: self._env.local_rank if self._env else 0)
    num_devices = property(lambda self: self._env.local_world_size if self._env
                           else self._processes)
    num_nodes = property(lambda self: self._env.nodes if self._env else 1)
    log_dir = property(lambda self: str(self.run_dir) if self.run_dir is not None else None)
    default_root_dir = property(lambda self: self.root_dir)
    checkpoint_callbacks = _callbacks_of("ModelCheckpoint")
    early_stopping_callbacks = _callbacks_of("EarlyStopping")
    checkpoint_callback = property(lambda self: next(iter(self.checkpoint_callbacks), None))
    early_stopping_callback = property(
        lambda self: next(iter(self.early_stopping_callbacks), None))

    @property
    def optimizers(self) -> list:
        """The optimizers, in order (a manual module's, or the one optimizer); [] before fit."""
        from meshtrain.module.manual import Optimizers

        made = self.optimizer
        return list(made) if isinstance(made, Optimizers) else [made] if made is not None else []
