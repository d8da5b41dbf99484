"""On a CUDA device: the non-finite flag is computed on the device, and no checkpoint holding
NaN/Inf is written (``pytest -m gpu``; skipped without a visible CUDA device)."""

import pytest
import torch
from fault_job import mlp, train
from records import checkpoints_are_finite
from test_nan_policy import NAN_INDEX, where_is

from meshtrain.fault.nonfinite import nonfinite_flag

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_flag_is_a_device_tensor_with_the_right_bits():
    layer = torch.nn.Linear(4, 2).cuda()
    loss = layer(torch.randn(3, 4, device="cuda")).sum()
    loss.backward()
    flag = nonfinite_flag(loss, layer.parameters())
    assert flag.device.type == "cuda" and flag.item() == 0
    layer.weight.grad[0, 0] = float("inf")
    assert nonfinite_flag(loss, layer.parameters()).item() == 2
    assert nonfinite_flag(loss * float("nan"), layer.parameters()).item() == 3


def test_no_checkpoint_with_non_finite_values_is_written_on_cuda(tmp_path):
    step, _ = where_is(NAN_INDEX)[0]
    with pytest.warns(UserWarning, match="NaN/Inf"):
        train(["--run-dir", str(tmp_path), "--max-steps", "8", "--ckpt-every", "1",
               "--nan-index", str(NAN_INDEX), "--nan-policy", "none", "--accelerator", "cuda"])
    saved = checkpoints_are_finite(tmp_path, mlp)
    assert [p.name for p in saved] == [f"step_{s:08d}" for s in range(1, step)]
