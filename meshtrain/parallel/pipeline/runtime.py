"""A leaner loop over the actions of torch's multi-stage schedules (interleaved 1F1B, looped
BFS, the zero-bubble ones): the same actions, in the same order, on the same stages.

torch's ``_PipelineScheduleRuntime`` runs every action of a step (interleaved 1F1B at p = 2, m = 8:
86 per rank, sends and receives included) through a closure that looks the stage up, checks FSDP
state and dispatches on the action's kind, under a ``record_function`` and a debug log call; a
send or receive builds ``P2POp`` objects and goes through ``batch_isend_irecv``'s wrapper. On CPU
stages of a few milliseconds that host work is a visible part of the bubble. Here the step's
plan is made once per schedule (each action's stage, whether its input comes from this rank or
must be waited for) and each action is a direct call; sends and receives are posted as torch's
``_batch_p2p`` posts a batch of one kind.

Used only where it is the same computation: stages without FSDP (whose UNSHARD / RESHARD
actions do work), no custom action functions, no fused OVERLAP_F_B actions, and no profiler
running (torch's loop names each action for it); anything else runs torch's own loop. The
private pieces it uses are torch 2.13's; on another torch the schedule runs its own loop.

Used on CPU stages only (:func:`lean_loop_for`): that is where it was measured faster. On
2026-11-28 on a 2-core CPU (`python benchmarks/pipeline.py --microbatches 8`, kept as
benchmarks/results/pipeline_loops_m8.json; benchmarks/README.md, "meshtrain's action loop
against torch's, again"), interleaved 1F1B at p = 2, m = 8 took 0.898x torch's loop's step time
on the same stages (paired; 197.9 against 213.5 ms), bubble 0.137 against 0.205, host time per
action 0.28 against 0.55 ms. It was never measured on a GPU, where the host work overlaps the
kernels, so CUDA (and any other device's) stages run torch's own ``_PipelineScheduleRuntime``.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import schedules as _torch

from meshtrain.parallel.shm.p2p import LocalP2PGroup

TORCH = "2.13."  # the torch whose private runtime this loop was written against
# (looked up by name: on another torch a missing kind is None and its schedules run torch's loop)
_KINDS = {name: getattr(getattr(_torch, "_ComputationType", None), name, None) for name in (
    "FORWARD", "FULL_BACKWARD", "BACKWARD_INPUT", "BACKWARD_WEIGHT", "SEND_F", "SEND_B",
    "RECV_F", "RECV_B", "UNSHARD", "RESHARD", "REDUCE_GRAD")}
FORWARD, FULL_BACKWARD = _KINDS["FORWARD"], _KINDS["FULL_BACKWARD"]
BACKWARD_INPUT, BACKWARD_WEIGHT = _KINDS["BACKWARD_INPUT"], _KINDS["BACKWARD_WEIGHT"]
SEND_F, SEND_B, RECV_F, RECV_B = (_KINDS[k] for k in ("SEND_F", "SEND_B", "RECV_F", "RECV_B"))
NO_WORK = (_KINDS["UNSHARD"], _KINDS["RESHARD"])  # what they do is FSDP's: left out of the plan
REDUCE_GRAD = _KINDS["REDUCE_GRAD"]
SUPPORTED = tuple(kind for kind in _KINDS.values() if kind is not None)


def _post(ops) -> list:
    """Post a list of sends, or of receives (what torch's ``_batch_p2p`` does with a batch of
    one kind); returns their works. On meshtrain's shared-memory group (shm/p2p.py) each is
    handed to the group itself, without ``isend``/``irecv``'s checks and dispatch (15-20 us a
    send here)."""
    assert len({p.op for p in ops}) <= 1, "a batch mixing sends and receives"
    send = bool(ops) and ops[0].op is _torch.dist.isend
    works = []
    for p in ops:
        if isinstance(p.group, LocalP2PGroup):
            post = p.group.send if send else p.group.recv
            works.append(post([p.tensor], p.group_peer, p.tag))
        elif send:
            works.append(_torch.dist.isend(p.tensor, group=p.group, tag=p.tag,
                                           group_dst=p.group_peer))
        else:
            works.append(_torch.dist.irecv(p.tensor, group=p.group, tag=p.tag,
                                           group_src=p.group_peer))
    return works


def _wait(works: list) -> None:
    """Wait for posted sends or receives (a function of its own: benchmarks time it)."""
    for work in works:
        work.wait()


class LeanRuntime:
    """Mixed in before a ``_PipelineScheduleRuntime`` subclass: its ``_step_microbatches`` runs
    the rank's plan directly where :meth:`_lean_plan` says it can, else torch's."""

    lean = True  # False: torch's own loop (benchmarks compare the two on the same stages)
    _plan: list | None = None
    _planned = False

    def _lean_plan(self) -> list | None:
        """(kind, stage, micro-batch, wait for a receive?, stage to hand the result to on this
        rank) per action of this rank, or None where torch's loop must run."""
        if not self._planned:
            self._planned, self._plan = True, self._make_plan()
        return self._plan

    def _make_plan(self) -> list | None:
        if (not torch.__version__.startswith(TORCH) or None in _KINDS.values()
                or self._comp_type_to_function_map):
            return None
        stages = {stage.stage_index: stage for stage in self._stages}
        if any(isinstance(stage.submod, FSDPModule) for stage in stages.values()):
            return None
        plan = []
        for action in self.pipeline_order_with_comms[self.rank]:
            kind, index = action.computation_type, action.stage_index
            if kind not in SUPPORTED or action.sub_actions is not None:
                return None
            if kind in NO_WORK:
                continue
            stage = stages[index]
            if kind == FORWARD:
                wait = not stage.is_first and index - 1 not in stages
                local = stages.get(index + 1)
            elif kind in (FULL_BACKWARD, BACKWARD_INPUT):
                wait = not stage.is_last and index + 1 not in stages
                local = stages.get(index - 1)
            else:
                wait, local = False, None
            plan.append((kind, stage, action.microbatch_index, wait, local))
        return plan

    def _step_microbatches(self, arg_mbs=None, kwarg_mbs=None, target_mbs=None, losses=None,
                           return_outputs=True, loss_kwargs=None):
        plan = self._lean_plan() if self.lean else None
        if plan is None or torch.autograd._profiler_enabled():
            return super()._step_microbatches(arg_mbs, kwarg_mbs, target_mbs, losses,
                                              return_outputs, loss_kwargs=loss_kwargs)
        arg_mbs, kwarg_mbs = self._check_inputs(arg_mbs, kwarg_mbs, target_mbs, losses)
        self._initialize_stages(arg_mbs[0], kwarg_mbs[0],
                                target_mbs[0] if target_mbs is not None else None, loss_kwargs)
        received: dict = {}  # (stage index, micro-batch, "F" or "B") -> the receives' works
        sent: list = []
        backwards: Counter = Counter()  # full or weight backwards run, per stage
        n = self._n_microbatches
        for kind, stage, mb, wait, local in plan:
            if kind == FORWARD:
                if wait:
                    _wait(received.pop((stage.stage_index, mb, "F")))
                output = stage.forward_one_chunk(mb, arg_mbs[mb], kwarg_mbs[mb],
                                                 save_forward_output=return_outputs)
                self._maybe_compute_loss(stage, output, target_mbs, mb, loss_kwargs)
                if local is not None:  # the next stage is on this rank (V layout)
                    local.set_local_fwd_input(output, mb)
            elif kind in (FULL_BACKWARD, BACKWARD_INPUT):
                if wait:
                    _wait(received.pop((stage.stage_index, mb, "B")))
                full = kind == FULL_BACKWARD
                if full:
                    backwards[stage.stage_index] += 1
                stage.backward_one_chunk(
                    mb, loss=self._maybe_get_loss(stage, mb), full_backward=full,
                    last_backward=full and backwards[stage.stage_index] == n)
                if local is not None:
                    local.set_local_bwd_input(stage.get_local_bwd_output(mb), mb)
            elif kind == BACKWARD_WEIGHT:
                backwards[stage.stage_index] += 1
                stage.backward_weight_one_chunk(
                    mb, last_backward=backwards[stage.stage_index] == n)
            elif kind == SEND_F:
                sent += _post(stage.get_fwd_send_ops(mb))
            elif kind == SEND_B:
                sent += _post(stage.get_bwd_send_ops(mb))
            elif kind == RECV_F:
                received[stage.stage_index, mb, "F"] = _post(stage.get_fwd_recv_ops(mb))
            elif kind == RECV_B:
                received[stage.stage_index, mb, "B"] = _post(stage.get_bwd_recv_ops(mb))
            elif kind == REDUCE_GRAD:
                stage.perform_reduce_grad(n if self.scale_grads else 1)
        assert not received, f"receives posted but never used: {sorted(received)}"
        _wait(sent)
        self._update_losses(self._stages, losses)


_LEAN: dict[type, type] = {}


def lean_loop_for(device: torch.device | str) -> bool:
    """Whether stages on ``device`` run meshtrain's action loop: on CPU, where it was measured
    faster than torch's (the module's docstring); elsewhere torch's own runtime."""
    return torch.device(device).type == "cpu"


def lean(schedule_class: type, device: torch.device | str) -> type:
    """``schedule_class`` with :class:`LeanRuntime`'s loop where it runs torch's runtime (the
    multi-stage schedules) on stages of ``device`` that :func:`lean_loop_for` gives it; a
    single-stage schedule (GPipe, 1F1B: a loop of its own), or stages on another device, get
    ``schedule_class`` as it is."""
    runtime = getattr(_torch, "_PipelineScheduleRuntime", None)
    if runtime is None or not issubclass(schedule_class, runtime) or not lean_loop_for(device):
        return schedule_class
    if schedule_class not in _LEAN:
        _LEAN[schedule_class] = type(schedule_class.__name__, (LeanRuntime, schedule_class),
                                     {"__doc__": schedule_class.__doc__})
    return _LEAN[schedule_class]
