"""Memory per device and step time of one layout, before anything runs.

Memory (the worst pipeline rank): model state from :class:`ModelStateSizes` (exact per rank);
activations from the model's own forward probed on meta (:mod:`meshtrain.plan.probe`), times
the micro-batch and the micro-batches a pipeline schedule keeps in flight (none: 1; GPipe: all;
1F1B: ``pp - rank``; interleaved: torch's warm-up count of chunks); the buffers FSDP gathers
(zero3: the root unit, or a block and the one prefetched; zero2: the whole stage, kept from
forward to backward; unsharded gradients while accumulating) or DDP's gradient buckets; the
largest transient (the loss's gradients, two fp32 vocabulary-wide tensors per token, or a block
recomputed under checkpointing); AdamW's step temporaries; and the allowance beside tensors:
the cluster's ``reserved`` (runtime, libraries, the CUDA caching allocator's reserve) plus, on
a host allocator that keeps freed memory, ``heap_keep`` of the activations and transients
(the layout family's where measured: ``Cluster.heap_keep_of``; both measured on this machine
by benchmarks/planner.py, so that the estimate predicts the
resident peak: with neither, it counts live tensors only). The peak (:attr:`Estimate.memory_total`) is not their sum: gradients and
activations are live together only while micro-batches accumulate (benchmarks/README.md, "The
planner against measured runs").

Step time: each micro-batch's FLOPs (probed, with the forward again under full checkpointing)
at the cluster's achieved FLOP/s (this machine: the job's model timed, meshtrain.plan.calibrate)
plus its tensor/context-parallel collectives (exposed) and pipeline sends; a pipeline runs
``m + (pp - 1) / v`` micro-batch slots of its heaviest stage (the bubble; processes sharing a
core fill part of it, and pool the stages' work: the mean stage's then counts, over the share
of the cores a pipeline keeps busy, ``Cluster.pp_core_use``);
data-parallel collectives, call by call, hide behind ``overlap`` of the compute; each collective
also waits the cluster's ``drift`` (a cp collective its ``cp_sync`` where measured: it sits
between uneven bursts of compute); the optimizer step streams its state once, a gradient
average by hand (no DDP or FSDP) its gradients three times; the activations checkpointing
drops are written again at the memory bandwidth.
"""

from __future__ import annotations

import math

import torch

from meshtrain.errors import ConfigError
from meshtrain.parallel.data.fully_shard import group_blocks
from meshtrain.parallel.layout import Layout
from meshtrain.plan.candidate import Candidate, Estimate, Job, peak
from meshtrain.plan.cluster import Cluster
from meshtrain.plan.model_state import ModelStateSizes
from meshtrain.plan.model_spec import ModelSpec
from meshtrain.plan.probe import Probe, probe_model
from meshtrain.settings import SETTINGS


class Estimator:
    """Estimates for one model, cluster and job; the model's probes and sizes are cached."""

    def __init__(self, spec: ModelSpec, cluster: Cluster, job: Job,
                 sizes: ModelStateSizes | None = None):
        self.spec, self.cluster, self.job = spec, cluster, job
        self.sizes = sizes or ModelStateSizes(spec.factory())
        self.dtype = torch.bfloat16 if cluster.dtype == "bf16-mixed" else torch.float32
        self.gather_factor = 0.5 if cluster.dtype == "bf16-mixed" else 1.0
        self._state: dict = {}
        self._one_block = spec.block_bytes()  # parameter bytes of one block
        self._block_experts = spec.block_bytes(experts_only=True) if spec.num_experts else 0
        # FSDP units: blocks grouped as the Trainer groups them (shard_unit_mb's default)
        self.unit_bytes = round(SETTINGS["shard_unit_mb"].default * 2**20)

    def state(self, layout: Layout, pp_rank: int, stages_per_rank: int = 1,
              schedule: str = "1f1b", *, unsharded: bool = False):
        """Model-state bytes of the first rank of pipeline rank ``pp_rank`` (``unsharded``: the
        same stage, tp split and ep share of the experts without data-parallel sharding, what
        FSDP gathers)."""
        if unsharded:
            ep = layout.expert_degree
            layout = Layout.parse(",".join(f"{a}={d}" for a, d in (
                ("pp", layout.degree("pp")), ("tp", layout.degree("tp")), ("ep", ep)) if d > 1)
                or "dp=1", layout.degree("pp") * layout.degree("tp") * ep)
        key = (str(layout), pp_rank, stages_per_rank, schedule)
        if key not in self._state:
            stride = layout.world_size // layout.degree("pp")
            self._state[key] = self.sizes.rank(layout, pp_rank * stride,
                                               pipeline=self.pipeline(stages_per_rank, schedule))
        return self._state[key]

    def pipeline(self, stages_per_rank: int, schedule: str):
        """The PipelineOptions of a candidate (Hugging Face models: their own adapter)."""
        from meshtrain.models.hf import hf_pp_support
        from meshtrain.parallel.pipeline.engine import PipelineOptions

        return PipelineOptions(adapter=hf_pp_support, schedule=schedule,
                               stages_per_rank=stages_per_rank)

    def probe(self, layout: Layout, candidate: Candidate) -> Probe:
        if self.spec.own:  # (data parallel and pp only: the model probed whole, as it is)
            from meshtrain.plan.probe import probe_own

            return probe_own(self.spec, self.dtype)
        return probe_model(self.spec, tp=layout.degree("tp"), cp=layout.degree("cp"),
                           sequence_parallel=candidate.sequence_parallel,
                           seq_len=self.job.seq_len, dtype=self.dtype)

    def estimate(self, candidate: Candidate) -> Estimate:
        c, job, cl = candidate, self.job, self.cluster
        layout = Layout.parse(c.layout, cl.world_size)
        per_rank, rest = divmod(job.global_batch, layout.batch_degree)
        if rest or per_rank % c.micro_batch:
            raise ConfigError(f"global batch {job.global_batch} does not split into "
                              f"{layout.batch_degree} data-parallel ranks x micro-batches of "
                              f"{c.micro_batch}")
        m = per_rank // c.micro_batch
        probe = self.probe(layout, c)
        pp, v = layout.degree("pp"), c.stages_per_rank if layout.degree("pp") > 1 else 1
        blocks = math.ceil(self.spec.num_layers / pp)
        kept = {None: probe.block.saved, "selective": probe.block.saved_selective,
                "full": probe.block.inputs}[c.activation_checkpointing]
        worst_memory, stage_times, states = None, {}, {}
        # the loss's backward starts with two fp32 vocabulary-wide tensors per token: the
        # gradients of the logits and of their log-softmax; a pipeline's last stage also keeps
        # its output, the logits, for the schedule
        logits = self.job.seq_len // layout.degree("cp") * self.spec.vocab_size * 4
        for r in sorted({0, pp - 1}):
            first, last = r == 0, r == pp - 1
            state = self.state(layout, r, v, c.pp_schedule)
            states[r] = state.total
            memory = {"params": state.params, "grads": state.grads, "optimizer": state.optimizer,
                      "gathered": self._gathered(layout, r, blocks, m, v, c.pp_schedule),
                      "activations": c.micro_batch * self._held(
                          layout, c, r, m, blocks, kept, probe, first, last),
                      "transient": c.micro_batch * max(
                          max(probe.last.saved, (2 + (pp > 1)) * logits) if last else 0,
                          probe.block.saved - kept if c.activation_checkpointing else 0),
                      "reserved": cl.reserved,
                      "allocator": 0.0,
                      "transport": self._transport(layout, c, r, blocks, v, probe),
                      "step_temporaries": self._step_temporaries(layout, state.params)}
            memory["allocator"] = cl.heap_keep_of(layout) * (memory["activations"]
                                                              + memory["transient"])
            if worst_memory is None or peak(memory, m > 1 or pp > 1) > peak(worst_memory,
                                                                               m > 1 or pp > 1):
                worst_memory = memory  # the first stage holds more in flight, the last the loss
            flops = blocks * (probe.block.flops + (probe.block.forward_flops if
                                                   c.activation_checkpointing == "full" else 0))
            flops += (probe.first.flops if first else 0) + (probe.last.flops if last else 0)
            # what checkpointing recomputes besides the matmuls: the dropped activations
            # written again (memory-bound: read and write)
            rewritten = blocks * (probe.block.saved - kept) * 2
            stage_times[r] = c.micro_batch * (flops / self._rate(layout, c)
                                              + rewritten / cl.memory_bw)
        if pp > 2:  # the stages between hold blocks only
            middle = blocks * (probe.block.flops + (probe.block.forward_flops if
                                                    c.activation_checkpointing == "full" else 0))
            stage_times.update(dict.fromkeys(range(1, pp - 1), c.micro_batch * (
                middle / self._rate(layout, c) + rewritten / cl.memory_bw)))
        seconds = self._time(layout, c, probe, m, blocks, max(stage_times.values()),
                             sum(stage_times.values()) / pp)
        return Estimate(c, m, worst_memory, seconds, states, accumulates=m > 1 or pp > 1)

    def _rate(self, layout: Layout, c: Candidate) -> float:
        """Achieved FLOP/s: the preset's, or on this machine the job's own model timed
        (meshtrain.plan.calibrate) and shared between the processes on each core."""
        if self.cluster.name == "this-machine":
            from meshtrain.plan.calibrate import achieved_flops

            measured = achieved_flops(self.spec, tp=layout.degree("tp"), cp=layout.degree("cp"),
                                      sequence_parallel=c.sequence_parallel,
                                      seq_len=self.job.seq_len, micro_batch=c.micro_batch)
            if measured is not None:
                return measured * self.cluster.compute_share
        return self.cluster.flops

    def _step_temporaries(self, layout: Layout, params: int) -> float:
        """AdamW's temporaries in its step: on GPUs (foreach) one tensor the size of all the
        rank's parameters; on CPU (one parameter at a time) two of the largest one."""
        if self.cluster.name != "this-machine":
            return params
        largest = max(math.prod(p.shape) * p.element_size for p in self.sizes.params)
        shards = layout.degree("tp") * (layout.degree("dp_shard") if layout.is_sharded else 1)
        return 2 * largest / shards

    # -- memory ---------------------------------------------------------------------------------
    def _held(self, layout, c, rank, m, blocks, kept, probe, first, last) -> float:
        """Activation bytes rank ``rank`` holds at its peak for one sample of micro-batch."""
        pp = layout.degree("pp")
        if pp == 1:
            chunks, per_chunk = 1, blocks
        elif c.pp_schedule == "gpipe":
            chunks, per_chunk = m, blocks
        elif c.stages_per_rank > 1:  # torch's interleaved warm-up, plus the one in flight
            v = c.stages_per_rank
            chunks = min(m * v, (v - 1) * pp + 2 * (pp - 1 - rank) + 1)
            per_chunk = blocks / v
        else:
            chunks, per_chunk = min(m, pp - rank), blocks
        micro_batches = chunks / (c.stages_per_rank if pp > 1 else 1)
        outside = (probe.first.saved if first else 0) + (probe.last.saved if last else 0)
        return chunks * per_chunk * kept + max(1.0, micro_batches) * outside

    def _transport(self, layout: Layout, c: Candidate, rank: int, blocks: int, v: int,
                   probe) -> float:
        """Bytes of the shared-memory rings a rank maps where its peers share the host and
        memory (a cluster measured with ``shared_table``: this machine, local_comm="auto"): per
        peer one it writes and one it reads (meshtrain/parallel/shm/p2p.py), each as large as
        it grows (``ring_bytes``: RING_MESSAGES of the largest message, or twice the first
        ring where a larger message follows it): FSDP's share of its largest unit after the
        root unit's, a pipeline's activation of one micro-batch, the tp axis's largest
        collective of one micro-batch (an all-reduce sends its whole tensor to each peer with
        2 ranks)."""
        if not self.cluster.shared_table:
            return 0.0
        from meshtrain.parallel.shm.p2p import ring_bytes

        def rings(peers: int, message: float, first: float | None = None) -> float:
            return 2 * peers * ring_bytes(message, first)

        total = 0.0
        if layout.is_sharded:  # the root unit is gathered first, its chunk the first message
            shards = layout.degree("dp_shard") * layout.degree("cp")
            whole = self.state(layout, rank, v, c.pp_schedule, unsharded=True).params
            units = self._fsdp_units(layout, whole, blocks)
            first = units[-1] if units[-1] > 0 else units[0]
            total += rings(shards - 1, max(units) / shards, first / shards)
        if layout.degree("pp") > 1:
            total += rings(min(2, layout.degree("pp") - 1), self._stage_message(layout, c))
        tp = [_message(coll) for coll in (*probe.block.comm, *probe.last.comm)
              if coll.axis == "tp"]
        if tp:
            total += rings(layout.degree("tp") - 1, max(tp) * c.micro_batch)
        return total

    def _fsdp_units(self, layout: Layout, whole: float, blocks: int) -> list[float]:
        """Parameter bytes of each FSDP unit of a rank's stage (its tp share), the root unit
        (what is not in a block: embedding, head) last; ``whole``: the stage's unsharded bytes."""
        units = [u / layout.degree("tp") for u in self._units(layout, blocks)]
        return [*units, max(0.0, whole - sum(units))]

    def _stage_message(self, layout: Layout, c: Candidate) -> float:
        """Bytes of one micro-batch's activation (or its gradient) sent between stages."""
        width = self.spec.hidden * self.job.seq_len // layout.degree("cp")
        size = c.micro_batch * width * (2 if self.dtype == torch.bfloat16 else 4)
        return size // layout.degree("tp") if c.sequence_parallel else size

    def _gathered(self, layout: Layout, rank: int, blocks: int, m: int, v: int,
                  schedule: str) -> float:
        """Bytes FSDP (or autocast) holds beyond the shards: gathered parameters and the
        unsharded gradients of the block being reduced."""
        whole = self.state(layout, rank, v, schedule, unsharded=True).params
        tp = layout.degree("tp")
        per_block = self._block(layout) / tp  # a block's (unsharded gradient, zero2)
        # zero3: a unit and the next one prefetched (blocks grouped as fully_shard groups them;
        # a block's experts are a unit of their own, gathered with it)
        two_units = sum(sorted(self._units(layout, blocks))[-2:]) / tp
        g = self.gather_factor
        if layout.uses_ddp:  # DDP's gradient buckets (not the experts': synced apart, bucketed)
            experts = blocks * self._block_experts / layout.expert_degree
            return max(0.0, whole - experts) + (whole * g if g < 1 else 0.0)
        if layout.is_sharded:
            # zero3 at the backward's start: the root unit (embedding, head), or a block and
            # the next one prefetched; zero2: the whole stage, and a block's unsharded gradient
            root = max(0.0, whole - per_block * blocks)
            gathered = max(root, two_units) * g if layout.zero_stage == 3 else \
                whole * g + per_block
            if m > 1:  # no reduce-scatter until the last micro-batch: gradients kept whole
                gathered += whole * g
            return gathered
        return whole * g if g < 1 else 0.0  # autocast's low-precision copies of the weights

    # -- time -----------------------------------------------------------------------------------
    def _time(self, layout: Layout, c: Candidate, probe: Probe, m: int, blocks: int,
              compute: float, mean_compute: float) -> dict:
        """Seconds of a step by part; ``compute``: a micro-batch's compute on the slowest
        pipeline stage, ``mean_compute``: the mean over the stages."""
        cl = self.cluster
        dpn = cl.devices_per_node
        inner = layout.degree("tp") * layout.degree("cp")
        tp_cp = 0.0
        for coll in (*probe.block.comm * blocks, *probe.last.comm):  # tp's: shared memory
            wait = (cl.cp_sync or {}).get(coll.ranks, cl.drift) if coll.axis == "cp" else \
                cl.drift
            tp_cp += wait + cl.comm_seconds(coll.op, coll.bytes * c.micro_batch, coll.ranks,
                                                crosses_nodes=inner > dpn, shared=coll.axis == "tp")
        pp = layout.degree("pp")
        p2p = 0.0
        if pp > 1:
            p2p = 2 * cl.comm_seconds("send_recv", self._stage_message(layout, c), 2, shared=True,
                                      crosses_nodes=layout.world_size // pp >= dpn)
        slot = compute + tp_cp + p2p
        slots = m + (pp - 1) / c.stages_per_rank if pp > 1 else m
        state = self.state(layout, 0, c.stages_per_rank, c.pp_schedule)
        whole = self.state(layout, 0, c.stages_per_rank, c.pp_schedule, unsharded=True)
        dp_comm = self._dp_comm(layout, state, whole, m, blocks)
        optimizer = 2 * (state.params + state.grads + state.optimizer) / cl.memory_bw
        # processes sharing a core (this machine) lend it while one waits, in the bubble and
        # while a lighter stage waits for the heaviest: the schedule then takes the longer of
        # its own span at a whole core and the mean stage's work shared (pp=2,tp=2 of the
        # planner benchmark: 0.74-0.84 of its prediction with the heaviest stage's work,
        # which the last stage's head and loss make 13 % heavier than the mean)
        share = cl.compute_share
        if share < 1:
            span, compute = slots * share * slot, mean_compute
            slot = compute + tp_cp + p2p
        else:
            span = slots * slot
        bubble = max(0.0, span - m * slot)
        # ... but not perfectly: a stage that sleeps on its peer lends its core to whatever
        # else runs; the pipeline then takes 1 / pp_core_use as long (measured here:
        # Cluster.pp_core_use)
        pp_idle = (m * slot + bubble) * (1 / cl.pp_core_use - 1) if pp > 1 and share < 1 else 0.0
        # gradients averaged by hand (pp, tp, cp without sharding: data_parallel.
        # allreduce_gradients) are flattened into one buffer, divided and copied back: three
        # passes over them besides the all-reduce (pp=2,dp=2 of the planner benchmark: 7-9 ms
        # of a rank's 0.21-0.23 s of CPU a step, 2026-12-01)
        averaging = 6 * state.grads / cl.memory_bw if layout.averages_gradients_by_hand else 0.0
        return {"compute": m * compute, "bubble": bubble, "pp_idle": pp_idle,
                "tp_cp_comm": m * tp_cp, "pp_p2p": m * p2p,
                "ep_comm": m * self._ep_seconds(layout, c, blocks),
                "dp_comm_exposed": max(0.0, dp_comm - cl.overlap * m * compute),
                "grad_averaging": averaging,
                "optimizer": optimizer, "sharding_host": self._sharding_host(layout, m, blocks)}

    def _ep_seconds(self, layout: Layout, c: Candidate, blocks: int) -> float:
        """ep's all-to-alls of one micro-batch: each MoE block sends its tokens' k copies to
        the experts' ranks and back, in the forward and again in the backward (4 a block;
        routing taken as balanced, as the probe routes)."""
        ep = layout.expert_degree
        if ep == 1:
            return 0.0
        tokens = c.micro_batch * self.job.seq_len // layout.degree("cp")
        size = tokens * self.spec.experts_per_token * self.spec.hidden * (
            2 if self.dtype == torch.bfloat16 else 4)
        crosses = ep * layout.degree("tp") > self.cluster.devices_per_node
        return 4 * blocks * (self.cluster.drift + self.cluster.comm_seconds(
            "all_to_all", size, ep, crosses_nodes=crosses))

    def _sharding_host(self, layout: Layout, m: int, blocks: int) -> float:
        """On this machine, what FSDP2's own work adds to a sharded step (meshtrain.plan.
        calibrate.sharding_host_seconds: the whole model measured in a simulated world), for
        this rank's part of the model (its stage's blocks, its tp share), shared per core."""
        if self.cluster.name != "this-machine" or not layout.is_sharded:
            return 0.0
        from meshtrain.plan.calibrate import sharding_host_seconds

        shards = layout.degree("dp_shard") * layout.degree("cp")
        measured = sharding_host_seconds(self.spec, shards, layout.zero_stage, self.job.seq_len)
        if measured is None:
            return 0.0
        per_micro_batch, per_step = measured
        part = blocks / self.spec.num_layers / layout.degree("tp")
        return (m * per_micro_batch + per_step) * part / self.cluster.compute_share

    def _block(self, layout: Layout) -> float:
        """A block's parameter bytes on a rank before data-parallel sharding and tp: under ep
        its share of the experts."""
        return self._one_block - self._block_experts * (1 - 1 / layout.expert_degree)

    def _units(self, layout: Layout, blocks: int) -> list[float]:
        """Parameter bytes (whole, before tp) of each FSDP unit of ``blocks`` blocks (under ep
        a block's dense part and its experts count as one: gathered together; their
        collectives are priced over the dp_shard ranks, the experts' run over fewer)."""
        block = self._block(layout)
        units = group_blocks([block] * blocks, self.unit_bytes, size=lambda b: b)
        return [sum(unit) for unit in units]

    def _dp_comm(self, layout: Layout, state, whole, m: int, blocks: int) -> float:
        """Data-parallel collectives of one step, call by call (each pays its latency): FSDP
        gathers and reduces each unit (blocks grouped as fully_shard.group_blocks groups them;
        the rest of the stage is the root unit); DDP
        all-reduces 25 MiB buckets; ZeRO-1 then broadcasts every parameter from its owner."""
        cl, dpn = self.cluster, self.cluster.devices_per_node
        inner = layout.degree("tp") * layout.degree("cp")
        seconds = 0.0
        if layout.is_sharded:
            shards = layout.degree("dp_shard") * layout.degree("cp")
            crosses = layout.degree("dp_shard") * inner > dpn
            gathers = 1 if layout.zero_stage == 2 else 2
            for size in self._fsdp_units(layout, whole.params, blocks):
                seconds += m * gathers * (cl.drift + cl.comm_seconds(
                    "all_gather", size * self.gather_factor, shards, crosses_nodes=crosses,
                    shared=True))
                seconds += cl.drift + cl.comm_seconds("reduce_scatter", size, shards,
                                                      crosses_nodes=crosses, shared=True)
            if layout.degree("dp_replicate") > 1:
                seconds += cl.comm_seconds("all_reduce", state.grads,
                                           layout.degree("dp_replicate"), crosses_nodes=True)
            return seconds
        ranks = layout.loss_degree
        crosses = layout.world_size // layout.degree("pp") > dpn
        buckets = max(1, math.ceil(state.grads / (25 * 2 ** 20)))
        seconds += buckets * (cl.drift + cl.comm_seconds("all_reduce", state.grads / buckets,
                                                         ranks, crosses_nodes=crosses))
        if layout.zero_stage == 1:
            tensors = max(1, round(len(self.sizes.params) / layout.degree("pp")))
            seconds += tensors * cl.comm_seconds("broadcast", state.params / tensors, ranks,
                                                 crosses_nodes=crosses)
        return seconds


def _message(coll) -> float:
    """The bytes a rank sends each peer at once in ``coll`` through shared memory
    (shm/collectives.py): an all-reduce of 2 ranks its whole tensor, else a chunk."""
    return coll.bytes if coll.op == "all_reduce" and coll.ranks == 2 else coll.bytes / coll.ranks
