"""``meshtrain parity``: does a layout change the training? Train a job K steps in one process and
under each layout, in fp32 and in float64, and compare every step's loss and gradient norm and
the final parameters.

    meshtrain parity CONFIG.toml --layouts "dp=2;zero3=2;tp=2;pp=2" --steps 10 [--section.key=value ...]
    meshtrain parity mypkg.train:job --layouts "dp=2;tp=2"    # a Python entry point

A config's recipe supplies the job through ``job(config)`` (the built-in ``char_lm`` does); an
entry point ``module:function`` returns the same mapping: ``model`` (a module factory),
``train_data``, ``optimizer`` (a factory), ``loss_fn`` and optionally ``lr_scheduler`` (a factory)
and ``settings`` (Trainer keywords, e.g. ``{"global_batch_size": 16}``; ``--section.key=value``
overrides them). Every run uses the job's settings with the layout replaced, less the settings
that need what its layout lacks (a ``tp_plan`` without tp); checkpoints, validation and loggers
are off (job.py). Each layout is judged in float64 against one process in float64 where the job
and the layout can run so (verdict.py); run.py trains the runs.
"""

from meshtrain.parity.cli import USAGE, main
from meshtrain.parity.job import QUIET, Source, layout_world_size, run_settings
from meshtrain.parity.run import REFERENCES, TOLERANCE, Curves, parity, train
from meshtrain.parity.verdict import (
    F64_TOL, HEADER, Row, compare, compare_float64, float64_job, table,
)

__all__ = ["F64_TOL", "HEADER", "QUIET", "REFERENCES", "TOLERANCE", "USAGE", "Curves", "Row",
           "Source", "compare", "compare_float64", "float64_job", "layout_world_size", "main",
           "parity", "run_settings", "table", "train"]
