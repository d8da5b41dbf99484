"""Context parallel's attention on a CUDA device: ring attention's blocks there are plain matrix
products (parallel/context/blockwise.py; no ``local_len x seq_len`` mask anywhere), and
meshtrain's GPT runs packed documents through FlexAttention with their ``BlockMask``.

``pytest -m gpu`` on a GPU machine; without a visible CUDA device every test here is skipped with
that reason (CI has none). The two cp ranks share one device (a one-GPU machine can run them):
their group is gloo, which moves the pieces through host memory (ring.py). float64 against one
process's SDPA on the same device: equal to rounding, as on CPU.
"""

from datetime import timedelta

import pytest
import torch
from test_context_parallel import _dense_reference, _packed_documents, run_attention

from meshtrain.launch.spawn import DistEnv, init_process_group, run_workers
from meshtrain.parallel.context.context_parallel import local_positions, shard_sequence

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _case(n: int, device: str = "cuda"):
    """q (4 heads), k, v (2 heads), loss weights of an ``n``-token float64 sequence and its
    packed documents."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, n, 16, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(2, 2, n, 16, generator=gen, dtype=torch.float64) for _ in range(2))
    weights = torch.randn(q.shape, generator=gen, dtype=torch.float64)
    return [t.to(device) for t in (q, k, v, weights, _packed_documents(n))]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("window", [None, 9])
def test_blocks_on_cuda_equal_dense_attention(window):
    """The blocks of cp=2's two ranks (pieces of 6 tokens), computed on the device, against one
    dense masked SDPA there: outputs and gradients (summed over the ranks)."""
    from meshtrain.parallel.context.blockwise import block_attention

    q, k, v, weights, docs = _case(48)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    reference = _dense_reference(q, k, v, window, docs)
    expected = torch.autograd.grad(reference, (q, k, v), weights)
    got = [torch.zeros_like(t) for t in (q, k, v)]
    for rank in range(2):
        mine = local_positions(24, rank, 2).to("cuda")
        pieces = [c * 2 + i for c in (rank, 3 - rank) for i in range(2)]
        out = block_attention(q[..., mine, :], k, v, pieces, 6, window=window, documents=docs)
        assert out.is_cuda and (out - reference[..., mine, :]).abs().max() < 1e-13
        for total, grad in zip(got, torch.autograd.grad(out, (q, k, v), weights[..., mine, :])):
            total += grad
    for total, want in zip(got, expected):
        assert (total - want).abs().max() < 1e-13


def _ring_rank():
    from torch.distributed.device_mesh import init_device_mesh

    from meshtrain.parallel.context.context_parallel import cp_attention

    env = DistEnv.from_environ()
    init_process_group(env, "gloo", timedelta(seconds=120))
    torch.cuda.set_device(0)
    mesh = init_device_mesh("cpu", (env.world_size,), mesh_dim_names=("cp",))
    rank = mesh.get_local_rank()
    q, k, v, weights, docs = _case(96)
    shards = [shard_sequence(t, rank, 2, dim=2) for t in (q, k, v, weights)]
    out = run_attention(lambda q, k, v: cp_attention(q, k, v, mesh, kv_groups=2, window=30,
                                                     documents=docs), *shards)
    assert all(t.is_cuda for t in out)
    return [t.cpu() for t in out]


@pytest.mark.timeout(300)
def test_cp2_attention_on_cuda_equals_one_process():
    """cp_attention on 2 ranks sharing the device (ring attention, 96 tokens, grouped-query
    heads, a sliding window, packed documents) against one process on the device."""
    results = run_workers(_ring_rank, 2, timeout=280)
    q, k, v, weights, docs = _case(96)
    reference = run_attention(lambda q, k, v: _dense_reference(q, k, v, 30, docs), q, k, v,
                              weights)
    for rank, result in enumerate(results):
        for name, got, full in zip(("out", "q.grad", "k.grad", "v.grad"), result, reference):
            want = shard_sequence(full, rank, 2, dim=2).cpu()
            assert (got - want).abs().max() < 1e-13, f"rank {rank} {name}"


@pytest.mark.timeout(300)
def test_gpt_documents_through_flexattention_on_cuda(monkeypatch):
    """meshtrain's GPT with packed documents on CUDA uses FlexAttention (compiled, the
    documents' BlockMask) by default: its loss and gradients equal the SDPA boolean-mask path's
    (fp32, TF32 off)."""
    from test_packing_gpt import documents, gpt

    from meshtrain.models import gpt_attention

    allow = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    kernel, calls = gpt_attention._flex_attention, []
    monkeypatch.setattr(gpt_attention, "_flex_attention",
                        lambda device: calls.append(device) or kernel(device))
    ids = torch.stack([torch.cat(documents(row)) for row in range(4)]).cuda()
    results = []
    try:
        for flex in (None, False):
            model = gpt().cuda()
            for layer in model.layers:
                layer.attn.flex_documents = flex
            logits = model(ids[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
            loss.backward()
            results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = allow
    assert len(calls) == 2  # the default path's two layers, not the SDPA run's
    (flex_loss, flex_grads), (sdpa_loss, sdpa_grads) = results
    torch.testing.assert_close(flex_loss, sdpa_loss, rtol=1e-5, atol=1e-6)
    for name, grad in sdpa_grads.items():
        torch.testing.assert_close(flex_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
