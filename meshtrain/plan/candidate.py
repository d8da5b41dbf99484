"""What the planner weighs: a candidate (a layout and the settings that change its cost), the
job, and a candidate's estimate (memory by part, time by part) with the peak of its parts."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One way to run the job: a layout and the settings that change its cost."""

    layout: str
    micro_batch: int
    activation_checkpointing: str | None = None
    sequence_parallel: bool = False
    pp_schedule: str = "1f1b"
    stages_per_rank: int = 1

    def __str__(self) -> str:
        parts = [self.layout, f"mb={self.micro_batch}"]
        if self.activation_checkpointing:
            parts.append(f"ac={self.activation_checkpointing}")
        if self.sequence_parallel:
            parts.append("sp")
        if "pp=" in self.layout:
            parts.append(self.pp_schedule + (f"x{self.stages_per_rank}"
                                             if self.stages_per_rank > 1 else ""))
        return " ".join(parts)

    def settings(self) -> dict:
        """The Trainer settings that run this candidate."""
        out = {"layout": self.layout, "micro_batch_size": self.micro_batch,
               "activation_checkpointing": self.activation_checkpointing}
        if self.sequence_parallel:
            out["sequence_parallel"] = True
        if "pp=" in self.layout:
            out.update(pp_schedule=self.pp_schedule, stages_per_rank=self.stages_per_rank)
        return out


@dataclasses.dataclass(frozen=True)
class Job:
    global_batch: int  # samples (sequences) per optimizer step
    seq_len: int


def peak(m: dict, accumulates: bool) -> float:
    """The most bytes live at once of the parts ``m`` (see :attr:`Estimate.memory_total`)."""
    backward = m["activations"] + m["transient"] + (m["grads"] if accumulates else 0)
    return (m["params"] + m["optimizer"] + m["gathered"] + m["reserved"] + m["transport"]
            + m["allocator"]
            + max(backward, m["grads"] + m["step_temporaries"]))


@dataclasses.dataclass(frozen=True)
class Estimate:
    candidate: Candidate
    accumulation: int  # micro-batches per rank per step
    memory: dict  # bytes by part on the worst rank
    seconds: dict  # step time by part
    model_state_rank: dict  # pp rank -> model-state bytes (params + grads + optimizer)
    accumulates: bool = False  # gradients held while micro-batches run (accumulation, pipeline)

    @property
    def memory_total(self) -> int:
        """The peak: what every moment holds (parameters, optimizer state, FSDP's gathered
        buffers, the allowance), plus the larger of the backward's start (activations and the
        loss's gradient; gradients too once a step accumulates several micro-batches) and the
        optimizer step (every gradient and the step's temporaries)."""
        return peak(self.memory, self.accumulates)

    @property
    def step_seconds(self) -> float:
        return sum(self.seconds.values())
