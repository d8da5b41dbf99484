"""Pipeline parallelism: stages cut from a model's blocks, run on a schedule over the pp axis."""

from meshtrain.parallel.pipeline.runner import PipelineRunner, clip_grad_norm_
from meshtrain.parallel.pipeline.stages import (
    _POST, SCHEDULES, SINGLE_STAGE, V_SHAPED, check_pipeline, pipeline_blocks, rank_stages,
    split_model,
)
from meshtrain.parallel.pipeline.timeline import (
    TimelineEvent, bubble_fraction, ideal_bubble_fraction, plot_timeline, replay,
)

__all__ = [
    "_POST", "SCHEDULES", "SINGLE_STAGE", "V_SHAPED", "PipelineRunner", "TimelineEvent",
    "bubble_fraction", "check_pipeline", "clip_grad_norm_", "ideal_bubble_fraction",
    "pipeline_blocks", "plot_timeline", "rank_stages", "replay", "split_model",
]
