"""Manual optimisation: a module that steps its optimizers itself (``automatic_optimization
= False``, a GAN), with Lightning's methods for it (meshtrain.TrainingModule has them, and a
LightningModule given as it is: lightning_module.py)."""

from __future__ import annotations

import contextlib

import torch

from meshtrain.errors import ConfigError


class Optimizers(list):
    """A manual module's optimizers, in order: what checkpoints save and load (DCP takes a list)
    and the memory table reads (their state together).

    After each optimizer's step autocast's cache of low-precision weight copies is cleared: the
    step runs in one autocast region, and a later forward in it (the generator's loss through
    the discriminator just stepped) must see the new weights, not the copies cast before."""

    def __init__(self, optimizers):
        super().__init__(optimizers)
        for optimizer in self:
            optimizer.register_step_post_hook(lambda *_: torch.clear_autocast_cache())

    @property
    def state(self) -> dict:
        return {p: s for optimizer in self for p, s in optimizer.state.items()}

    @property
    def param_groups(self) -> list:
        return [g for optimizer in self for g in optimizer.param_groups]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self:
            optimizer.zero_grad(set_to_none=set_to_none)

    def register_step_post_hook(self, hook):
        """``hook(self, args, kwargs)`` after each step once every optimizer has stepped (the
        memory table: all their state exists then); returns a handle with ``remove()``."""
        stepped: set[int] = set()

        def each(optimizer, args, kwargs):
            stepped.add(id(optimizer))
            if len(stepped) == len(self):
                hook(self, args, kwargs)

        handles = [optimizer.register_step_post_hook(each) for optimizer in self]
        return _Handles(handles)


class _Handles:
    def __init__(self, handles):
        self.handles = handles

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


class ManualOptimization:
    """``self.optimizers()``, ``self.manual_backward(loss)``, ``self.clip_gradients`` and
    Lightning's toggles, answered by the Trainer fitting the module (``self.trainer``)."""

    def optimizers(self):
        """(manual optimisation) The optimizers ``configure_optimizers`` returned, in order; the
        one itself when it returned one (as Lightning gives it)."""
        optimizers = list(self.trainer.optimizer)
        return optimizers[0] if len(optimizers) == 1 else optimizers

    def manual_backward(self, loss: torch.Tensor) -> None:
        """(manual optimisation) ``loss.backward()``, then the gradients averaged over the
        data-parallel ranks (FSDP2 reduce-scatters them inside backward)."""
        self.trainer.engine.manual_backward(loss)

    def clip_gradients(self, optimizer: torch.optim.Optimizer, max_norm: float) -> torch.Tensor:
        """(manual optimisation) Clip the gradients of ``optimizer``'s parameters to the global
        L2 norm ``max_norm`` (over every rank's shards); returns their norm before clipping.
        Call it after ``manual_backward`` and before ``optimizer.step()``."""
        params = [p for group in optimizer.param_groups for p in group["params"]]
        return self.trainer.engine.clip_grad_norm(max_norm, params)

    def toggle_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """(Lightning's; manual optimisation) Until :meth:`untoggle_optimizer`, only
        ``optimizer``'s parameters require gradients: a backward then skips the others' (a
        GAN's generator step computes no gradient for the discriminator). Not under zero2,
        zero3 or HSDP: FSDP2 gathers each parameter into a copy of its own, which keeps
        requiring gradients whatever the sharded parameter says."""
        layout = self.trainer.layout
        if layout.is_sharded:
            raise ConfigError(
                f"toggle_optimizer under {layout}: FSDP2 computes with gathered copies of the "
                "parameters, whose requires_grad a toggle does not reach, so the other "
                "optimizers' gradients would still be computed and added to. Drop the toggles "
                "and zero each optimizer's gradients just before its backward, or train on a "
                "layout that does not shard (dp)")
        made = self.trainer.optimizer
        saved: dict = {}
        for each in (made if isinstance(made, Optimizers) else [made]):
            for group in each.param_groups:
                for param in group["params"]:
                    saved.setdefault(param, param.requires_grad)
                    param.requires_grad_(False)
        for group in optimizer.param_groups:
            for param in group["params"]:
                param.requires_grad_(saved.get(param, param.requires_grad))
        self.__dict__["_toggled"] = saved

    def untoggle_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """(Lightning's) Every parameter requires gradients again as before the toggle."""
        for param, wanted in self.__dict__.pop("_toggled", {}).items():
            param.requires_grad_(wanted)

    @contextlib.contextmanager
    def toggled_optimizer(self, optimizer: torch.optim.Optimizer):
        """(Lightning's) :meth:`toggle_optimizer` for the ``with`` block."""
        self.toggle_optimizer(optimizer)
        try:
            yield
        finally:
            self.untoggle_optimizer(optimizer)
