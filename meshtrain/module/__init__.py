"""Research code on the model, as Lightning users write it: ``training_step``,
``validation_step``, ``configure_optimizers`` and ``self.log`` (:class:`TrainingModule`)."""

from meshtrain.module.core import TrainingModule, has_steps

__all__ = ["TrainingModule", "has_steps"]
