"""Helpers shared by the tests. tests/ is on sys.path (pyproject's ``pythonpath``), so a test
imports them with ``from conftest import ...``; the fixtures need no import.

* ``one_thread``, ``one_thread_per_module``: one torch thread while a test (module) runs.
* ``quiet_trainer`` / ``trainer_kwargs``: a CPU Trainer without loggers, progress bar, report
  or final checkpoint; ``LossRecorder``, ``RecordingDataset``, ``state_of``, ``full_loss``,
  ``sgd_momentum``: what the Trainer tests record and compare.
* ``join_gloo``, ``gloo_mesh``, ``end_together``: the start and end of a worker started by
  ``run_workers``; ``max_diff``, ``assert_matches_one_process``: its parameters against one
  process's. (Trainer-level parity with one process is ``parity.py``'s.)
* ``ROOT``, ``script_env``: scripts started as processes of their own.
* with ``CI`` set (the CI's run), a test that skips for want of a program, server or package
  fails instead, saying what is missing; only ``gpu`` tests skip there (``ci_skips.py``).

Functions that run in worker processes may live here: the workers import this module by name.
"""

from __future__ import annotations

import contextlib
import os
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from ci_skips import pytest_make_collect_report, pytest_runtest_makereport  # noqa: F401 (hooks)
from torch.utils.data import Dataset

from meshtrain import Callback
from meshtrain.launch import spawn

ROOT = Path(__file__).resolve().parents[1]

# One torch thread per process in the whole suite (the processes it starts inherit it): the
# Trainer then keeps it instead of sharing the cores itself (launch/world.py); tests of that rule
# unset it. Several threads per process on a busy 2-core machine crawl.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# run_workers' processes fork from one server (which imports meshtrain.launch.worker_imports):
# add what the tests' workers import besides
# (transformers and its Llama: the Hugging Face tests' workers; a missing module is skipped)
spawn.FORKSERVER_PRELOAD += ["parity", "transformers", "transformers.modeling_utils",
                             "transformers.models.llama.modeling_llama"]


# ---- one torch thread ---------------------------------------------------------------------------
@contextlib.contextmanager
def torch_threads(n: int):
    threads = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture
def one_thread(monkeypatch):
    """One torch thread here and in every process started from the test: they inherit
    OMP_NUM_THREADS, which also stops the Trainer from choosing a thread count itself. Several
    threads on a busy machine crawl. Use it with ``pytest.mark.usefixtures("one_thread")``."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    with torch_threads(1):
        yield


@pytest.fixture(scope="module")
def one_thread_per_module():
    """One torch thread for a whole module, for module-scoped fixtures that train in this
    process (a one-process reference to compare the workers with)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OMP_NUM_THREADS", "1")
        with torch_threads(1):
            yield


# ---- a quiet Trainer and what the Trainer tests record --------------------------------------------
def trainer_kwargs(run_dir, **settings) -> dict:
    """A quiet CPU Trainer's settings, writing into ``run_dir``: no loggers, no progress bar, no
    report, no final checkpoint, seed 0, global batch 16; ``settings`` add to or replace them."""
    return {"loggers": (), "progress_bar": False, "save_final_checkpoint": False,
            "report": False, "run_dir": run_dir, "seed": 0, "global_batch_size": 16,
            "accelerator": "cpu", **settings}


@pytest.fixture
def no_processes(monkeypatch):
    """Fails the test if ``fit`` gets as far as starting processes: a refusal must come first."""
    def no_world(*args, **kwargs):
        raise AssertionError("the checks let it through: processes would start")

    monkeypatch.setattr("meshtrain.loop.setup.start_world", no_world)


def quiet_trainer(run_dir, **settings):
    from meshtrain import Trainer

    return Trainer(**trainer_kwargs(run_dir, **settings))


class LossRecorder(Callback):
    """A fit, step by step: ``losses`` {global step: train/loss} (every step with
    log_every_n_steps=1), ``steps`` the global step at the end of each step, and how many
    epochs started."""

    def __init__(self):
        self.losses: dict[int, float] = {}
        self.steps: list[int] = []
        self.epochs_started = 0

    @property
    def steps_ended(self) -> int:
        return len(self.steps)

    def on_train_epoch_start(self, trainer):
        self.epochs_started += 1

    def on_train_step_end(self, trainer, metrics):
        self.steps.append(trainer.global_step)
        if "train/loss" in metrics:
            self.losses[trainer.global_step] = metrics["train/loss"]


class RecordingDataset(Dataset):
    """A map-style dataset that records which indices were fetched (in this process)."""

    def __init__(self, base: Dataset):
        self.base, self.fetched = base, []

    def __len__(self):
        return len(self.base)

    def __getitem__(self, index):
        self.fetched.append(int(index))
        return self.base[index]


def state_of(model) -> dict:
    """A copy of ``model``'s state dict."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@torch.no_grad()
def full_loss(model, dataset) -> float:
    """The mean squared error over every sample of a ``TensorDataset``, by hand, in one batch."""
    x, y = dataset.tensors
    was_training = model.training
    model.eval()
    loss = F.mse_loss(model(x), y).item()
    model.train(was_training)
    return loss


def sgd_momentum(params):
    # SGD, not AdamW: Adam divides by |g|, so a coordinate whose mean gradient is ~0 can flip sign
    # under any rounding and move by a full lr; SGD shows the communication error as it is.
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


# ---- workers started by run_workers ---------------------------------------------------------------
def join_gloo() -> tuple[int, int]:
    """Join the worker's job in a gloo process group (60 s timeout); (rank, world size)."""
    import torch.distributed as dist

    from meshtrain.launch.spawn import DistEnv, init_process_group

    init_process_group(DistEnv.from_environ(), "gloo", timedelta(seconds=60))
    return dist.get_rank(), dist.get_world_size()


def gloo_mesh(shape: tuple[int, ...], names: tuple[str, ...] | None = None):
    """Join the job (``join_gloo``) and return a CPU device mesh of ``shape`` named ``names``."""
    from torch.distributed.device_mesh import init_device_mesh

    join_gloo()
    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def end_together(result=None):
    """Return ``result`` once every rank got here. The group is destroyed at exit (spawn's
    atexit): destroying it here, before DDP and the optimizer are freed on return, hung gloo in
    ~4 runs out of 10."""
    import torch.distributed as dist

    dist.barrier()
    return result


def max_diff(a: dict, b: dict) -> float:
    """The largest absolute difference between two dicts of tensors with the same keys."""
    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


# attn.wk.bias has an exactly zero gradient in exact arithmetic (softmax ignores a shift shared by
# all keys), so its gradient is rounding noise that AdamW's normalised step turns into moves of
# ~lr under any change of summation order (any parallel layout): it is compared loosely.
NOISE_ONLY = ".attn.wk.bias"


def assert_matches_one_process(reference: dict, params: dict, what: str) -> None:
    """A GPT's parameters within 1e-5 of one process's (``NOISE_ONLY`` within 1e-3)."""
    tight = [k for k in reference if not k.endswith(NOISE_ONLY)]
    diff = max_diff({k: reference[k] for k in tight}, {k: params[k] for k in tight})
    assert diff <= 1e-5, f"{what} differs from one process by {diff:.3e}"
    assert max_diff(reference, params) <= 1e-3, f"{what}: {NOISE_ONLY} drifted too far"


# ---- scripts started as processes of their own ---------------------------------------------------
LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MESHTRAIN_STORE")


def script_env(base: dict | None = None) -> dict:
    """The environment of a script run with ``python``: ``base`` (default: this process's
    environment less the launcher's variables), meshtrain and tests/ importable, one OMP thread."""
    if base is None:
        base = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    env = dict(base)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT), str(ROOT / "tests"), *filter(None, [env.get("PYTHONPATH")])])
    env["OMP_NUM_THREADS"] = "1"
    return env


def run_script(script, *args, cwd, pid_dir, timeout: float):
    """``python script args...`` as a user starts it (``script_env``), its output captured;
    afterwards every process that wrote its pid into ``pid_dir/*.pid`` (a script's ranks: rank 1
    runs in its own session) is ended if it is still there."""
    import signal
    import subprocess
    import sys

    try:  # a job that hangs raises TimeoutExpired
        return subprocess.run([sys.executable, str(script), *map(str, args)], env=script_env(),
                              capture_output=True, text=True, timeout=timeout, cwd=cwd)
    finally:
        for pid_file in Path(pid_dir).glob("*.pid"):
            try:
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass


# ---- token shards as `meshtrain prepare` writes them --------------------------------------------
@pytest.fixture(scope="session")
def example_corpus(tmp_path_factory):
    """Prepared token shards with one global batch of the cluster examples (examples/llama_1b_*:
    256 sequences of 2048 tokens) in the training split: ~600k tokens of generated Python,
    a 300-token tokenizer (prepared in about a second)."""
    from meshtrain.data.prepare import prepare

    texts = tmp_path_factory.mktemp("example_texts")
    for i in range(24):
        (texts / f"doc{i:02d}.py").write_text("".join(
            f"def f{i}_{j}(x):\n    return x * {j} + {i * j}\n" for j in range(1200)))
    out = tmp_path_factory.mktemp("example_corpus")
    prepare([texts], out, train_tokenizer_vocab=300, val_fraction=0.05, overwrite=True,
            log=lambda *a: None)
    return out


def rank_1_plans_backwards():
    """(A parity ``setup``.) On rank 1, the planner's rows come slowest first, so that rank's
    own layout="auto" pick differs from rank 0's (tests/plan/test_auto.py)."""
    import meshtrain.plan.planner as planner

    if os.environ.get("RANK") == "1":
        plan = planner.plan

        def backwards(*args, **kwargs):
            result = plan(*args, **kwargs)
            result.rows.reverse()
            return result

        planner.plan = backwards
