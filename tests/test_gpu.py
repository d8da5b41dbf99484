"""On a CUDA device: the one-process Trainer trains like the CPU one.

``pytest -m gpu`` on a GPU machine; without a visible CUDA device these are skipped with that
reason (CI has none). fp32 with TF32 off, so CPU and GPU differ only by kernel rounding.
"""

import pytest
import torch
from parity import GRAD_NORMS, LOSSES, compare_ranks, sgd, train_state

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(autouse=True)
def no_tf32():
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.mark.parametrize("clip", [None, 0.05])
def test_cuda_trainer_matches_cpu_with_gradient_norms(clip):
    common = dict(max_steps=10, global_batch_size=16, micro_batch_size=4, log_grad_norm=True,
                  grad_clip_norm=clip)
    cpu = train_state(dict(common, accelerator="cpu"))
    gpu = train_state(dict(common, accelerator="cuda"))
    assert len(gpu[GRAD_NORMS]) == 10 and not gpu[GRAD_NORMS].isnan().any()
    compare_ranks(cpu, [gpu], tol=1e-5, label="cuda")
    assert len(gpu[LOSSES]) == 10


def test_cuda_trainer_matches_cpu_under_sgd():
    common = dict(max_steps=10, global_batch_size=16, log_grad_norm=True)
    cpu = train_state(dict(common, accelerator="cpu"), optimizer_fn=sgd)
    gpu = train_state(dict(common, accelerator="cuda"), optimizer_fn=sgd)
    compare_ranks(cpu, [gpu], tol=1e-5, label="cuda")
