"""Which action loop a multi-stage pipeline schedule runs: meshtrain's (pipeline/runtime.py) on
CPU stages, where benchmarks/pipeline.py measured it faster (benchmarks/README.md), torch's own
``_PipelineScheduleRuntime`` on CUDA stages (never measured there). The CUDA side is checked on
CPU through the decision function, and for real by the ``gpu`` test."""

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.pipelining import Schedule1F1B, ScheduleInterleaved1F1B

from meshtrain.launch.spawn import run_workers
from meshtrain.parallel.pipeline.runtime import LeanRuntime, lean, lean_loop_for

CONFIG = dict(vocab_size=16, seq_len=8, num_layers=4, d_model=16, num_heads=2)
STEPS, BATCH, MICRO = 3, 8, 4


def test_the_loop_is_chosen_by_the_stages_device():
    assert lean_loop_for("cpu") and lean_loop_for(torch.device("cpu"))
    assert not lean_loop_for("cuda") and not lean_loop_for(torch.device("cuda", 1))
    on_cpu = lean(ScheduleInterleaved1F1B, torch.device("cpu"))
    assert issubclass(on_cpu, LeanRuntime) and issubclass(on_cpu, ScheduleInterleaved1F1B)
    assert lean(ScheduleInterleaved1F1B, torch.device("cuda", 0)) is ScheduleInterleaved1F1B
    assert lean(Schedule1F1B, "cpu") is Schedule1F1B  # a loop of its own either way


def runner_worker(device: str, as_if_cuda: bool):
    """One rank holding both stages of interleaved 1F1B (pp=1, 2 stages): 3 SGD steps on
    ``device``; ``as_if_cuda``: the device decision answers as it does for CUDA stages."""
    from conftest import gloo_mesh

    from meshtrain.models.gpt import GPT, GPTConfig
    from meshtrain.parallel.pipeline import PipelineRunner, runtime, split_model

    asked = []
    if as_if_cuda:  # (this worker process only)
        runtime.lean_loop_for = lambda device: asked.append(str(device)) or False
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    mesh = gloo_mesh((1,), ("pp",))
    model = GPT(GPTConfig(**CONFIG), seed=0)
    modules = [split_model(model, [2], i).to(device) for i in (0, 1)]

    def loss_fn(logits, targets):
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    runner = PipelineRunner(modules, [0, 1], 2, mesh["pp"], torch.device(device),
                            schedule="interleaved-1f1b", num_microbatches=MICRO, loss_fn=loss_fn)
    opt = torch.optim.SGD(runner.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(7)
    x = torch.randint(0, 16, (STEPS, BATCH, 8), generator=gen)
    losses = []
    for step in range(STEPS):
        losses.append(runner.step(x[step].to(device), ((3 * x[step] + 1) % 16).to(device)).item())
        opt.step()
        opt.zero_grad()
    loop = type(runner.schedule)
    return dict(loop="meshtrain's" if issubclass(loop, LeanRuntime) else
                "torch's" if loop is ScheduleInterleaved1F1B else loop.__name__, asked=asked,
                losses=losses,
                params={n: p.detach().cpu() for m in runner.modules
                        for n, p in m.named_parameters()})


def same_training(a: dict, b: dict, tol: float) -> None:
    assert max(abs(x - y) for x, y in zip(a["losses"], b["losses"])) <= tol
    assert a["params"].keys() == b["params"].keys()
    assert max((a["params"][n] - b["params"][n]).abs().max().item() for n in a["params"]) <= tol


@pytest.mark.timeout(60)
def test_a_runner_takes_the_loop_its_device_gets():
    (own,) = run_workers(runner_worker, 1, ("cpu", False), timeout=50)
    (torchs,) = run_workers(runner_worker, 1, ("cpu", True), timeout=50)
    assert own["loop"] == "meshtrain's"
    assert torchs["asked"] == ["cpu"]  # about the stages' device
    assert torchs["loop"] == "torch's"  # torch's class, its own runtime
    assert own["losses"][-1] < own["losses"][0]  # it trained
    same_training(own, torchs, 1e-6)  # the same actions in the same order


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.timeout(120)
def test_cuda_stages_run_torchs_loop_and_train_as_the_cpu_loop_does():
    (cpu,) = run_workers(runner_worker, 1, ("cpu", False), timeout=100)
    (cuda,) = run_workers(runner_worker, 1, ("cuda", False), timeout=100)
    assert cpu["loop"] == "meshtrain's" and cuda["loop"] == "torch's"
    same_training(cpu, cuda, 1e-5)  # fp32, TF32 off: kernel rounding only
