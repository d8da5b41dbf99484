"""Mixed precision on CUDA against fp32 on the CPU, in units of the format's unit roundoff u:
tests/test_gpu_path.py's 8-step run of the 4-block GPT, with cuBLAS's reduced-precision
reductions (allow_{fp16,bf16}_reduced_precision_reduction) on (torch's default) and off.

    python3 benchmarks/mixed_precision_cuda.py      # on a GPU machine, from the repository root
"""
import sys

sys.path.insert(0, "tests")
import torch  # noqa: E402
from parity import train_state  # noqa: E402
from test_mixed_precision import FNS, UNIT_ROUNDOFF, deviation  # noqa: E402

COMMON = dict(max_steps=8, global_batch_size=16, log_grad_norm=True)
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
fp32 = train_state(dict(COMMON, accelerator="cpu"), **FNS)
for reduced in (True, False):
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = reduced
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = reduced
    for precision in ("bf16-mixed", "fp16-mixed"):
        half = train_state(dict(COMMON, accelerator="cuda", precision=precision), **FNS)
        d = deviation(half, fp32)
        u = UNIT_ROUNDOFF[precision]
        print(precision, "reduced_precision_reduction", reduced, "in units of u:",
              {k: round(v / u, 4) for k, v in d.items()}, flush=True)
fp32_cuda = train_state(dict(COMMON, accelerator="cuda"), **FNS)
print("fp32 cuda vs cpu (absolute):", deviation(fp32_cuda, fp32))
