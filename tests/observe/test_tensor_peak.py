"""TensorPeak: the peak bytes of live tensors in a block, on CPU (meshtrain/observe/memory/tensor_peak.py):
what benchmarks/planner.py checks the planner's memory estimates against."""

from __future__ import annotations

import torch

from meshtrain.observe.memory.tensor_peak import TensorPeak


def test_counts_live_storages_once_until_freed():
    resize = torch.UntypedStorage.resize_
    with TensorPeak() as peak:
        a = torch.ones(1000)                  # 4000 bytes
        b = a * 2                             # 8000
        view = b[:10]                         # a view: no new storage
        b.add_(1)                             # in place: none either
        del a                                 # 4000
        c = torch.empty(2000)                 # 12000: the peak
        c.untyped_storage().resize_(0)        # FSDP frees its gathered buffers this way: 4000
        c.untyped_storage().resize_(4000)     # and gathers again: 8000
    assert (peak.bytes, peak.now) == (12000, 8000)
    assert torch.UntypedStorage.resize_ is resize  # put back
    del view


def test_autograd_and_the_optimizer_count():
    model = torch.nn.Linear(64, 64)  # made before: not counted
    optimizer = torch.optim.AdamW(model.parameters())
    with TensorPeak() as peak:
        model(torch.randn(8, 64)).square().sum().backward()
        optimizer.step()
    weights = (64 * 64 + 64) * 4
    # the gradients and AdamW's two moments stay; the activations went
    assert peak.now >= 3 * weights and peak.bytes > peak.now
