"""The planner: probes read from the model's own code, model state equal to a simulated world,
and clear refusals (meshtrain/plan/)."""

from __future__ import annotations

import json

import pytest
import torch

from meshtrain.cli import main as cli
from meshtrain.parallel.layout import Layout
from meshtrain.plan.cluster import Cluster
from meshtrain.plan.estimate import Candidate, Estimator, Job
from meshtrain.plan.model_spec import ModelSpec
from meshtrain.plan.planner import plan
from meshtrain.plan.probe import probe_model
from meshtrain.plan.simulate import simulate

pytestmark = pytest.mark.timeout(300)

D, S = 256, 128
GPT = f"gpt:num_layers=4,num_heads=8,d_model={D},vocab_size=512,seq_len={S}"
LLAMA_1B = ("llama:num_hidden_layers=16,hidden_size=2048,intermediate_size=8192,"
            "num_attention_heads=32,num_key_value_heads=8,vocab_size=32000,"
            "max_position_embeddings=4096")


def test_block_flops_are_the_matmul_formula():
    probe = probe_model(ModelSpec.load(GPT), seq_len=S)
    # forward + backward = 3 x forward; 12 d^2 weights per block, attention 4 s^2 d forward
    assert probe.block.flops == 3 * (2 * 12 * D * D * S + 4 * S * S * D)
    assert probe.block.forward_flops * 3 == probe.block.flops
    assert probe.block.inputs == S * D * 4  # fp32 hidden state: what full checkpointing keeps


def test_tensor_parallel_collectives_are_megatrons():
    spec = ModelSpec.load(GPT)
    one, tp = probe_model(spec, seq_len=S), probe_model(spec, tp=2, seq_len=S)
    # two all-reduces of the hidden state forward, two backward, per block
    assert [(c.op, c.bytes, c.ranks) for c in tp.block.comm] == [("all_reduce", S * D * 4, 2)] * 4
    assert {c.axis for c in tp.block.comm} == {"tp"}  # on the tp axis's group (shared memory)
    assert tp.block.saved < one.block.saved and tp.block.flops * 2 == one.block.flops
    sp = probe_model(spec, tp=2, sequence_parallel=True, seq_len=S)
    # the hidden state is gathered and scattered instead (the small all-reduces are the
    # replicated norm weights' gradients)
    big = sorted((c.op, c.bytes) for c in sp.block.comm if c.bytes >= S * D)
    assert big == [("all_gather", S * D * 4)] * 4 + [("reduce_scatter", S * D * 4)] * 4
    assert sp.block.inputs * 2 == one.block.inputs  # the block input is split over tp


def test_activation_checkpointing_keeps_less():
    probe = probe_model(ModelSpec.load(GPT), seq_len=S)
    assert probe.block.inputs < probe.block.saved_selective < probe.block.saved
    job, cluster = Job(8, S), Cluster.preset("8xh100")
    est = Estimator(ModelSpec.load(GPT), cluster, job)
    memory = {ac: est.estimate(Candidate("dp=8", 1, ac)).memory["activations"]
              for ac in (None, "selective", "full")}
    assert memory["full"] < memory["selective"] < memory[None]


@pytest.mark.parametrize("pin", [None, "pp"])
def test_model_state_of_the_pick_equals_the_simulated_world(pin):
    """The estimate's model-state bytes are those of the pick built for real at world size 64."""
    spec = ModelSpec.load(LLAMA_1B)
    cluster = Cluster.preset("8xH100", nodes=8)
    job = Job(256, 4096)
    pins = {"pp": 4} if pin else None
    estimator = Estimator(spec, cluster, job)
    pick = plan(spec, cluster, job, pins=pins, estimator=estimator).pick
    layout = pick.candidate.layout
    assert ("pp=4" in layout) == bool(pin)
    pp = 4 if pin else 1
    for pp_rank, total in pick.model_state_rank.items():
        built = simulate(spec.factory(), layout, rank=pp_rank * (64 // pp),
                         pipeline=estimator.pipeline(pick.candidate.stages_per_rank,
                                                     pick.candidate.pp_schedule))
        assert built.total == total, (layout, pp_rank)
    if pin:  # interleaved: two stages per rank, not the consecutive ones (with uniform blocks
        # a rank holds as many bytes either way: built at 10, 16 and 18 layers on 2026-11-26)
        interleaved = estimator.estimate(Candidate("pp=4,zero3=16", 1, "full",
                                                   pp_schedule="interleaved-1f1b",
                                                   stages_per_rank=2))
        built = simulate(spec.factory(), "pp=4,zero3=16", rank=64 - 16,
                         pipeline=estimator.pipeline(2, "interleaved-1f1b"))
        assert interleaved.model_state_rank[3] == built.total


def test_bad_inputs_are_refused_with_the_fix(capsys):
    assert cli(["plan", GPT, "--cluster", "8xA100", "--global-batch", "8", "--seq-len", "128"]) == 2
    assert "unknown cluster preset '8xa100'" in capsys.readouterr().err
    # a model that fits nowhere: exit 1, naming the smallest layout's need
    assert cli(["plan", "examples/llama3/405b.json", "--global-batch", "8",
                "--seq-len", "8192"]) == 1
    err = capsys.readouterr().err
    assert "no layout fits" in err and "use more devices" in err
    # a batch that divides no data-parallel degree: every layout but pure tp is refused
    assert cli(["plan", GPT, "--global-batch", "3", "--seq-len", "128", "--pin", "dp=8"]) == 2
    assert "does not split over 8 data-parallel ranks" in capsys.readouterr().err
    assert cli(["plan", GPT, "--global-batch", "8", "--seq-len", "128", "--pin", "tp=3"]) == 2
    assert "no layout of 8 devices has tp=3 for this job (tp=3 does not divide 8 devices)" in \
        capsys.readouterr().err
    assert cli(["plan", GPT, "--global-batch", "8", "--seq-len", "4096"]) == 2
    assert "above the model's maximum" in capsys.readouterr().err


def test_plan_prints_ranked_layouts(capsys):
    assert cli(["plan", GPT, "--global-batch", "16", "--seq-len", "128", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "  1  " in out and "fit," in out
    assert torch.distributed.is_initialized() is False


def test_model_strings_take_words():
    spec = ModelSpec.load("llama:num_hidden_layers=2,hidden_size=64,intermediate_size=128,"
                          "num_attention_heads=4,vocab_size=128,hidden_act=silu,"
                          "tie_word_embeddings=false")
    assert spec.config.hidden_act == "silu" and spec.config.tie_word_embeddings is False


def test_memory_near_torchtitans_published_figure():
    """torchtitan's docs/performance.md (Table 1): Llama 3.1 8B on 8 H100s, FSDP over 8, local
    batch 2, sequence 8192, selective checkpointing, eager: 82.4 GiB peak reserved. The
    estimate (77.5 GiB on 2026-11-26: live tensors and a flat 4 GiB, not the allocator's cache)
    must stay within 10 % of it (docs/planner.md)."""
    spec = ModelSpec.load("examples/llama3/8b.json")
    estimate = Estimator(spec, Cluster.preset("8xH100"), Job(16, 8192)).estimate(
        Candidate("zero3=8", 2, "selective"))
    published = 82.4 * 2 ** 30
    assert -0.10 <= estimate.memory_total / published - 1 <= 0.10, estimate.memory
    # fp32 master weights as the Trainer keeps them, though the config's torch_dtype is bf16
    assert estimate.memory["params"] == 4 * 8_030_261_248 // 8


def test_the_h200_preset_against_the_1b_llama_measured_on_one_h200():
    """The one run of the 8xH200 preset's kind of device measured here (a lent H200,
    2026-11-26: benchmarks/mfu.py, the 1.1B Llama, bf16-mixed, sequence 2048, micro-batch 4,
    fused AdamW, one GPU; benchmarks/results/mfu_h200_eager.json and, compiled,
    mfu_h200.json): the preset's estimate of that job (989 TFLOP/s x 40 %, 4 GiB reserved)
    is 0.153 s and 35.5 GiB against 0.162 s and 33.9 GiB of peak reserved memory eager, and
    over the compiled run (0.120 s, 27.9 GiB), which the estimate does not model. Kept
    within 10 % of the eager run (docs/planner.md)."""
    import dataclasses
    from pathlib import Path

    results = Path(__file__).parents[2] / "benchmarks/results"
    eager, compiled = (json.loads((results / name).read_text()) for name in
                       ("mfu_h200_eager.json", "mfu_h200.json"))
    config = eager["config"]
    assert (config["layers"], config["hidden"], config["vocab"], config["seq_len"],
            config["micro_batch"], config["compile"]) == (16, 2048, 32000, 2048, 4, False)
    one = dataclasses.replace(Cluster.preset("8xH200"), devices_per_node=1)
    estimate = Estimator(ModelSpec.load(LLAMA_1B), one, Job(4, 2048)).estimate(
        Candidate("dp=1", 4))
    step, memory = eager["result"]["median_step_s"], eager["result"]["peak_reserved_gib"]
    assert abs(estimate.step_seconds / step - 1) <= 0.10, (estimate.step_seconds, step)
    assert abs(estimate.memory_total / 2**30 / memory - 1) <= 0.10, (estimate.memory, memory)
    assert estimate.step_seconds > compiled["result"]["median_step_s"]
    assert estimate.memory_total / 2**30 > compiled["result"]["peak_reserved_gib"]


def test_plan_build_builds_the_pick(capsys):
    assert cli(["plan", GPT, "--global-batch", "16", "--seq-len", "128", "--top", "1",
                "--pin", "pp=2", "--build"]) == 0
    out = capsys.readouterr().out
    built = [line for line in out.splitlines() if line.startswith("  rank ")]
    assert [line.split(":")[0] for line in built] == ["  rank 0", "  rank 4"]  # both stages
    assert all("equal" in line for line in built), built
    assert torch.distributed.is_initialized() is False


def test_processes_sharing_a_core_fill_the_bubble_and_collectives_pay_the_drift():
    """On a machine with fewer cores than processes a pipeline's idle slots are lent to the
    other processes (the bubble costs what they cannot fill), and each collective waits for
    the ranks' drift (meshtrain bench comm measures it) besides moving its bytes."""
    import dataclasses

    spec, job = ModelSpec.load(GPT), Job(16, S)
    h100 = Cluster.preset("8xh100")
    pipeline = Candidate("pp=2,dp=4", 1)  # 2 micro-batches per rank, 3 slots
    whole = Estimator(spec, h100, job).estimate(pipeline).seconds
    half = Estimator(spec, dataclasses.replace(h100, compute_share=0.5), job).estimate(
        pipeline).seconds
    assert whole["bubble"] > 0 and half["bubble"] == 0  # 3 slots x 0.5 <= 2 micro-batches
    tp = Candidate("tp=8", 2)
    plain = Estimator(spec, h100, job).estimate(tp).seconds["tp_cp_comm"]
    drift = Estimator(spec, dataclasses.replace(h100, drift=0.001), job).estimate(tp)
    probe = probe_model(spec, tp=8, seq_len=S)
    calls = len(probe.block.comm) * spec.num_layers + len(probe.last.comm)
    assert drift.seconds["tp_cp_comm"] - plain == pytest.approx(0.001 * calls * drift.accumulation)


def test_processes_sharing_a_core_pool_the_stages_work():
    """Sharing cores, a lighter pipeline stage lends its core while it waits for the heaviest
    (the last, with the head and the loss): the step's compute is the mean stage's; with a
    core each, the heaviest stage's."""
    import dataclasses

    spec, job = ModelSpec.load(GPT), Job(16, S)
    h100 = Cluster.preset("8xh100")
    pipeline, flat = Candidate("pp=2,dp=4", 1), Candidate("dp=8", 1)
    for share in (1.0, 0.5):
        cluster = dataclasses.replace(h100, compute_share=share)
        staged = Estimator(spec, cluster, job).estimate(pipeline).seconds["compute"]
        whole = Estimator(spec, cluster, job).estimate(flat).seconds["compute"]
        # dp=8 runs every block and both ends on 2 samples; each stage of pp=2,dp=4 half the
        # blocks and one end on 4: the mean stage's work is the whole model's
        if share < 1:
            assert staged == pytest.approx(whole, rel=1e-6)
        else:
            assert staged > whole * 1.02


def test_cp_collectives_wait_the_measured_cp_sync_instead_of_the_drift():
    """A cp collective sits between uneven bursts of compute: where its in-step wait is
    measured (benchmarks/cp_sync.py) it pays that instead of the drift; tp's are unchanged
    (the probe tags each collective with its mesh axis)."""
    import dataclasses

    spec, job = ModelSpec.load(GPT), Job(16, S)
    h100 = dataclasses.replace(Cluster.preset("8xh100"), drift=0.001)
    probe = probe_model(spec, tp=2, cp=4, seq_len=S)
    axes = {c.axis for c in (*probe.block.comm, *probe.last.comm)}
    assert {"tp", "cp"} <= axes
    cp_calls = sum(c.axis == "cp" for c in probe.block.comm) * spec.num_layers + sum(
        c.axis == "cp" for c in probe.last.comm)
    assert cp_calls > 0
    synced = dataclasses.replace(h100, cp_sync={4: 0.011, 2: 0.5})  # (no cp=2 group here)
    for layout, calls in (("cp=4,tp=2", cp_calls), ("tp=8", 0)):
        before = Estimator(spec, h100, job).estimate(Candidate(layout, 2))
        after = Estimator(spec, synced, job).estimate(Candidate(layout, 2))
        assert after.seconds["tp_cp_comm"] - before.seconds["tp_cp_comm"] == pytest.approx(
            0.010 * calls * after.accumulation)


def test_measured_cp_sync_is_read_back_at_its_process_count(tmp_path):
    from meshtrain.plan.cluster import measured_cp_sync

    path = tmp_path / "planner.json"
    assert measured_cp_sync(path, 4) is None
    path.write_text(json.dumps({"cp_sync": {"world": 4, "cp_sync": {"2": 0.008, "4": 0.013}}}))
    assert measured_cp_sync(path, 4) == {2: 0.008, 4: 0.013}
    assert measured_cp_sync(path, 2) is None


def test_a_pipeline_on_shared_cores_takes_its_measured_core_use_longer():
    """Sharing cores, a pipeline's stages pool their work imperfectly (a stage sleeping on its
    peer lends its core to anything else that runs): where that is measured
    (Cluster.pp_core_use, benchmarks/pp_core_use.py) the pipeline's schedule takes
    1 / pp_core_use as long; data parallel, and a pipeline with a core per process, do not."""
    import dataclasses

    spec, job = ModelSpec.load(GPT), Job(16, S)
    shared = dataclasses.replace(Cluster.preset("8xh100"), compute_share=0.5)
    slower = dataclasses.replace(shared, pp_core_use=0.8)
    pipeline = Candidate("pp=2,dp=4", 1)
    before = Estimator(spec, shared, job).estimate(pipeline)
    after = Estimator(spec, slower, job).estimate(pipeline)
    s = before.seconds
    schedule = s["compute"] + s["bubble"] + s["tp_cp_comm"] + s["pp_p2p"]
    assert before.seconds["pp_idle"] == 0
    assert after.seconds["pp_idle"] == pytest.approx(schedule * (1 / 0.8 - 1))
    assert after.step_seconds - before.step_seconds == pytest.approx(after.seconds["pp_idle"])
    for cluster, candidate in ((slower, Candidate("dp=8", 1)),
                               (dataclasses.replace(slower, compute_share=1.0), pipeline)):
        assert Estimator(spec, cluster, job).estimate(candidate).seconds["pp_idle"] == 0


def test_gradients_averaged_by_hand_cost_three_passes_over_them():
    """Where no wrapper averages the gradients (pp, tp, cp without sharding), the Trainer
    flattens them into one buffer, divides it and copies it back
    (data_parallel.allreduce_gradients): three reads and writes of the rank's gradients at the
    memory bandwidth; DDP's and FSDP's layouts, and one process, pay none."""
    spec, job = ModelSpec.load(GPT), Job(16, S)
    cluster = Cluster.preset("8xh100")
    estimator = Estimator(spec, cluster, job)
    for layout in ("pp=2,dp=4", "dp=4,tp=2", "cp=2,dp=4"):
        grads = estimator.state(Layout.parse(layout, 8), 0).grads
        assert estimator.estimate(Candidate(layout, 1)).seconds["grad_averaging"] == \
            pytest.approx(6 * grads / cluster.memory_bw)
    for layout in ("dp=8", "zero3=8", "zero1=8", "zero2=4,tp=2", "tp=8"):
        assert estimator.estimate(Candidate(layout, 2)).seconds["grad_averaging"] == 0


def test_measured_pp_core_use_is_read_back_at_its_process_count(tmp_path):
    from meshtrain.plan.cluster import measured_pp_core_use

    path = tmp_path / "planner.json"
    assert measured_pp_core_use(path, 4) == 1.0
    path.write_text(json.dumps({"pp_core_use": {"world": 4, "pp_core_use": 0.93}}))
    assert measured_pp_core_use(path, 4) == 0.93
    assert measured_pp_core_use(path, 8) == 1.0


def test_shared_memory_prices_fsdp_and_pipeline_sends_and_its_rings_count():
    """A CPU job on one host sends FSDP's all-gathers and reduce-scatters and a pipeline's
    activations through shared memory (local_comm="auto"): with a measured shared table the
    estimate prices those calls with it (not gloo's) and counts the rings each rank maps (one
    it writes and one it reads per peer, RING_MESSAGES of the largest message); without one
    (a GPU preset) nothing changes."""
    import dataclasses

    from meshtrain.parallel.shm.p2p import MIN_RING, RING_MESSAGES, ring_bytes

    spec, job = ModelSpec.load(GPT), Job(16, S)
    gloo = dataclasses.replace(Cluster.preset("8xh100"), name="cpu", dtype="fp32",
                               comm_table={op: [(1, 1e-3), (2**30, 1.0)] for op in
                                           ("all_gather", "reduce_scatter", "send_recv",
                                            "all_reduce")})
    shm = dataclasses.replace(gloo, shared_table={op: [(1, 1e-5), (2**30, 0.01)] for op in
                                                  ("all_gather", "reduce_scatter", "send_recv")})
    for layout in ("zero3=8", "pp=2,dp=4"):
        slow = Estimator(spec, gloo, job).estimate(Candidate(layout, 1))
        fast = Estimator(spec, shm, job).estimate(Candidate(layout, 1))
        part = "dp_comm_exposed" if layout.startswith("zero") else "pp_p2p"
        assert fast.seconds[part] < slow.seconds[part] / 5
        assert slow.memory["transport"] == 0
    zero3 = Estimator(spec, shm, job)
    units = zero3._units(Layout.parse("zero3=8", 8), 4)  # blocks as units
    root = sum(p.numel() for p in spec.build().parameters()) * 4 - sum(units)  # sent first
    # a ring's first message is the root unit's chunk, then a block's (larger): as large as
    # it grows (ring_bytes, checked against the rings in tests/parallel/test_shm_p2p.py)
    shard, first = max(units) / 8, root / 8
    assert first < shard
    assert zero3.estimate(Candidate("zero3=8", 1)).memory["transport"] == \
        2 * 7 * ring_bytes(shard, first)
    activation = 1 * D * S * 4  # one micro-batch of one sample, fp32
    assert Estimator(spec, shm, job).estimate(Candidate("pp=2,dp=4", 1)).memory["transport"] \
        == 2 * 1 * max(MIN_RING, RING_MESSAGES * activation)
    assert Estimator(spec, shm, job).estimate(Candidate("dp=8", 1)).memory["transport"] == 0


def test_shared_memory_prices_the_tp_axis_when_its_table_has_all_reduce():
    """The tp axis's collectives go through shared memory on one host (shm/collectives.py):
    a shared table with all_reduce prices them (a table measured before has none: gloo's rows
    then), and the rings its ranks map count."""
    import dataclasses

    from meshtrain.parallel.shm.p2p import MIN_RING, RING_MESSAGES

    spec, job = ModelSpec.load(GPT), Job(32, S)
    ops = ("all_gather", "reduce_scatter", "send_recv", "all_reduce")
    gloo = dataclasses.replace(Cluster.preset("8xh100"), name="cpu", dtype="fp32",
                               comm_table={op: [(1, 1e-3), (2**30, 1.0)] for op in ops})
    before = dataclasses.replace(gloo, shared_table={op: [(1, 1e-5), (2**30, 0.01)]
                                                     for op in ops[:3]})
    shm = dataclasses.replace(gloo, shared_table={op: [(1, 1e-5), (2**30, 0.01)] for op in ops})
    layout, candidate = "dp=4,tp=2", Candidate("dp=4,tp=2", 8)  # a rank's 8 samples at once
    slow = Estimator(spec, gloo, job).estimate(candidate).seconds["tp_cp_comm"]
    fast = Estimator(spec, shm, job).estimate(candidate).seconds["tp_cp_comm"]
    # without all_reduce rows only the logits' all-gather is priced by the shared table
    assert fast < slow / 5 < Estimator(spec, before, job).estimate(candidate).seconds[
        "tp_cp_comm"] < slow
    probe = Estimator(spec, shm, job).probe(Layout.parse(layout, 8), candidate)
    # the largest message a rank sends its peer: the logits' all-gather, half of them
    largest = max(c.bytes / 2 for c in probe.last.comm if c.op == "all_gather")
    assert largest == S * spec.vocab_size * 4 / 2
    assert RING_MESSAGES * largest * 8 > MIN_RING
    assert Estimator(spec, shm, job).estimate(candidate).memory["transport"] == \
        2 * 1 * RING_MESSAGES * largest * 8  # a ring it writes and one it reads


def test_a_job_toml_is_planned_with_its_recipes_defaults_moe_included(capsys):
    """`meshtrain plan examples/X.toml`: the job's model with its recipe's defaults (it failed
    to import before: the reader named a function config.py does not have). An MoE job is
    planned, tp included (every expert split by hidden unit), and its tp pick built."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    dense = ModelSpec.load(str(root / "examples" / "char_gpt.toml"))
    assert dense.num_experts == 0 and dense.num_layers == 4
    assert cli(["plan", str(root / "examples" / "moe_gpt.toml"), "--cluster", "8xH100",
                "--global-batch", "64", "--seq-len", "128", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "  1  dp=8" in out or "  1  zero" in out, out
    assert "tp=2:" not in out  # (refused until meshtrain split experts by hidden unit)
    assert "pp=2: meshtrain balances the routers" not in out  # (inside the stages: moe/pipeline.py)
    assert cli(["plan", str(root / "examples" / "moe_gpt.toml"), "--cluster", "8xH100",
                "--global-batch", "64", "--seq-len", "128", "--top", "1", "--pin", "tp=2",
                "--build"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"built \S*tp=2 at world size 8 .*\n.*model state [\d.]+ GiB \(estimated "
                     r"[\d.]+ GiB: equal\)", out), out
    moe = ModelSpec.load(str(root / "examples" / "moe_gpt.toml"))
    assert moe.num_experts == 8 and not moe.balances_routers
    assert probe_model(moe, seq_len=32) is not None  # on meta: routed as if balanced


def test_an_moe_model_is_planned_with_expert_parallel_and_its_pick_built(capsys):
    """A Qwen3-30B-A3B-shaped model (examples/moe/qwen3_30b_a3b.json, 128 experts, top-8) on
    2 x 8 H100: candidates with ep (experts per rank counted by rows, sharded over edp by FSDP, the
    all-to-alls timed), the pick built in a simulated world of 16 ranks with the model state
    the estimate said. (On one node of 8 nothing fits: fp32 weights and AdamW state alone are
    57 GiB a device.)"""
    import re

    assert cli(["plan", "examples/moe/qwen3_30b_a3b.json", "--cluster", "8xH100", "--nodes",
                "2", "--global-batch", "16", "--seq-len", "4096", "--top", "20", "--build"]) == 0
    out = capsys.readouterr().out
    picks = re.findall(r"^\s+\d+  (\S+) mb=", out, flags=re.M)
    assert any("ep=" in p for p in picks), out
    assert "tp=2: meshtrain does not split a Hugging Face model's experts by tensor parallel" \
        in out
    built = re.search(r"built (\S+) at world size 16", out)
    assert built and "ep=" in built.group(1), out
    assert out.count("estimated") == out.count("equal)") >= 2, out


def test_ep_can_be_pinned_and_combines_with_hsdp(tmp_path, capsys):
    """--pin ep=E keeps the layouts whose experts are split E ways (ep borrows data-parallel
    ranks: it adds none, so it is not a factor of the world size; before, no layout matched),
    and on two nodes the candidates include HSDP with ep."""
    import json

    from meshtrain.parallel.layout import Layout

    def rows(*args):
        out = tmp_path / "plan.json"
        assert cli(["plan", "examples/moe_gpt.toml", "--global-batch", "64", "--seq-len", "128",
                    "--json", str(out), *args]) == 0
        return [r["candidate"].split()[0] for r in json.loads(out.read_text())["rows"]]

    pinned = rows("--pin", "ep=2")
    assert pinned and all(Layout.parse(c, 8).expert_degree == 2 for c in pinned), pinned
    hsdp = rows("--nodes", "2", "--pin", "dp_replicate=2,ep=4")
    assert hsdp and all(c.startswith("dp_replicate=2,") and c.endswith(",ep=4") for c in hsdp)
    capsys.readouterr()


def test_a_deepseek_v3_shaped_model_is_planned_on_256_devices_and_its_pick_built(capsys):
    """DeepSeek-V3's shape (examples/moe/deepseek_v3.json: 671B, 256 experts of 58 MoE blocks,
    top-8, multi-head latent attention) on 32 x 8 H100: the probe runs its latent attention
    (values narrower than keys) and prices its blocks as MoE ones (not its 3 dense first),
    FSDP's gathered parameters count a rank's ep share of the experts (before, every layout
    was 'too big': a whole stage of experts gathered), the table has an ep column, and the pick
    is built in a simulated world of 256 ranks with the model state the estimate said."""
    import re

    assert cli(["plan", "examples/moe/deepseek_v3.json", "--cluster", "8xH100", "--nodes",
                "32", "--global-batch", "256", "--seq-len", "4096", "--top", "3",
                "--build"]) == 0
    out = capsys.readouterr().out
    assert "671.03B parameters" in out and re.search(r"dp\s+ep\n", out), out
    built = re.search(r"built (\S+) at world size 256", out)
    assert built and "ep=" in built.group(1), out
    assert out.count("estimated") == out.count("equal)") >= 1, out


def test_a_70b_pipeline_pick_sets_up_at_its_shard_size(capsys):
    """Llama 3 70B on 32 x 8 H100 with pp: the pick built in a simulated world reports each
    pipeline end's set-up as the Trainer would run it (the same choice: built on the meta
    device, meshtrain.loop.setup.choose_build), holding its shards (its parameters' bytes),
    not the 263 GiB model; what is drawn at once is one module (the embedding or the head)."""
    import re

    assert cli(["plan", "examples/llama3/70b.json", "--nodes", "32", "--global-batch", "256",
                "--seq-len", "4096", "--top", "1", "--pin", "pp=2", "--build"]) == 0
    out = capsys.readouterr().out
    setups = re.findall(r"rank (\d+): ([\d.,]+)M parameters.*\n\s+set-up: built on the meta "
                        r"device, the rank holds its shards, ([\d.]+) GiB, and draws at most "
                        r"([\d.]+) GiB at once on the host \((\S+) whole.*against (\d+) GiB", out)
    assert [s[0] for s in setups] == ["0", "128"], out
    for _, params, held, staged, module, whole in setups:
        assert float(held) == pytest.approx(float(params.replace(",", "")) * 4e6 / 2**30, abs=0.06)
        assert float(held) + float(staged) < float(whole) / 40
    assert {s[4] for s in setups} == {"model.embed_tokens", "lm_head"}


def test_measured_host_allowance_is_added_for_the_allocator_it_was_measured_on(tmp_path):
    """The resident estimate (benchmarks/planner.py measures ``reserved`` and ``heap_keep``):
    the allowance adds ``reserved`` plus ``heap_keep`` of the activations and transients to the
    peak, and this-machine reads it back only for the allocator it was measured on."""
    import dataclasses
    import json

    from meshtrain.plan.cluster import host_allocator, measured_allowance

    spec, job = ModelSpec.load(GPT), Job(8, S)
    bare = dataclasses.replace(Cluster.preset("8xh100"), reserved=0)
    kept = dataclasses.replace(bare, reserved=40 << 20, heap_keep=0.5)
    candidate = Candidate("dp=8", 1)
    plain, resident = (Estimator(spec, c, job).estimate(candidate) for c in (bare, kept))
    transient = plain.memory["activations"] + plain.memory["transient"]
    assert resident.memory["allocator"] == 0.5 * transient
    assert resident.memory_total - plain.memory_total == (40 << 20) + 0.5 * transient
    path = tmp_path / "planner.json"
    assert measured_allowance(path) == (0, 0.0, None)  # not measured: live tensors only
    families = {"cp": 1.5, "pp": 1.25, "tp": 0.75}
    for allocator, expected in ((host_allocator(), (40 << 20, 0.5, families)),
                                ("other", (0, 0.0, None))):
        path.write_text(json.dumps({"allowance": {"allocator": allocator, "reserved": 40 << 20,
                                                  "heap_keep": 0.5, "families": families}}))
        assert measured_allowance(path) == expected


def test_the_heap_allowance_is_the_layout_familys():
    """Where the fraction the host allocator keeps is measured by layout family, a layout takes
    its family's (cp=8's ``"cp"``), a mix not measured the largest of its axes' (pp x tp: pp's),
    a family none of whose axes was measured the single ``heap_keep``."""
    import dataclasses

    from meshtrain.parallel.layout import Layout
    from meshtrain.plan.cluster import heap_family

    spec, job = ModelSpec.load(GPT), Job(8, S)
    bare = dataclasses.replace(Cluster.preset("8xh100"), reserved=0)
    kept = dataclasses.replace(bare, heap_keep=0.5, heap_keep_by_family={
        "cp": 1.5, "pp": 1.25, "tp": 0.75, "tp+shard": 0.25})
    assert [heap_family(Layout.parse(s, 8)) for s in ("dp=8", "zero1=8", "zero3=8", "cp=8",
                                                      "pp=2,tp=2,zero2=2")] == \
        ["dp", "dp", "shard", "cp", "pp+tp+shard"]
    for layout, fraction in (("cp=8", 1.5), ("pp=2,tp=4", 1.25), ("tp=4,zero3=2", 0.25),
                             ("tp=8", 0.75), ("dp=8", 0.5), ("zero3=8", 0.5)):
        candidate = Candidate(layout, 1)
        plain, resident = (Estimator(spec, c, job).estimate(candidate) for c in (bare, kept))
        transient = plain.memory["activations"] + plain.memory["transient"]
        assert resident.memory["allocator"] == pytest.approx(fraction * transient), layout
