"""The Trainer's loop around its core (meshtrain/trainer.py): setting up before fit, the
loop's state, the end of each step and epoch, validation and test, prediction."""
