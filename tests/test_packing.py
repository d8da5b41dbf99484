"""Packed documents kept apart (meshtrain.packing): no attention and no target across a document
boundary, so packed training is training on the documents one per row, under every layout."""

import pytest
import torch
import torch.nn.functional as F
import transformers  # noqa: F401  (the `test` extra installs it: these tests never skip)
from parity import LOSSES, adamw_gpt, assert_parity, params_of, train_state

from meshtrain.models.hf import tiny_llama
from meshtrain.packing import cut_targets, document_block_mask, document_ids, document_mask

torch.set_num_threads(1)
SEQ, ROWS, VOCAB = 16, 40, 32


def _lengths(row: int) -> tuple[int, int]:
    """Two documents fill each packed row (their lengths vary from row to row)."""
    first = 3 + (7 * row) % 11
    return first, SEQ - first


def _tokens(row: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (SEQ,), generator=torch.Generator().manual_seed(row))


def packed_docs() -> list[dict]:
    """Each row two documents: position ids restarting at the second, its first label cut."""
    rows = []
    for row in range(ROWS):
        ids = _tokens(row)
        first, second = _lengths(row)
        positions = torch.cat([torch.arange(first), torch.arange(second)])
        rows.append({"input_ids": ids, "labels": cut_targets(ids, positions),
                     "position_ids": positions})
    return rows


def unpacked_docs() -> list[dict]:
    """The same documents one per row, padded at the end (attention mask 0, labels -100)."""
    rows = []
    for row in range(ROWS):
        ids = _tokens(row)
        first, _ = _lengths(row)
        for doc in (ids[:first], ids[first:]):
            pad = SEQ - len(doc)
            mask = torch.cat([torch.ones(len(doc), dtype=torch.long),
                              torch.zeros(pad, dtype=torch.long)])
            padded = F.pad(doc, (0, pad))
            rows.append({"input_ids": padded, "attention_mask": mask,
                         "labels": padded.masked_fill(mask == 0, -100)})
    return rows


def llama():
    return tiny_llama(num_layers=4, seq_len=SEQ)


FNS = dict(model_fn=llama, data_fn=packed_docs, loss_fn=None, optimizer_fn=adamw_gpt)


def test_document_ids_and_mask_follow_the_positions():
    positions = torch.tensor([[3, 4, 0, 1, 2, 0, 0, 1]])  # a document begun before the window
    assert document_ids(positions).tolist() == [[0, 0, 1, 1, 1, 2, 3, 3]]
    mask = document_mask(positions)[0, 0]
    assert mask[4].tolist() == [False, False, True, True, True, False, False, False]
    assert mask[7].tolist() == [False] * 6 + [True, True]
    assert torch.equal(document_mask(torch.arange(8)[None])[0, 0],
                       torch.ones(8, 8, dtype=torch.bool).tril())
    # a model of your own: SDPA with the mask is attention within each document
    q, k, v = (torch.randn(1, 2, 8, 4, dtype=torch.float64) for _ in range(3))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    alone = F.scaled_dot_product_attention(q[..., 2:5, :], k[..., 2:5, :], v[..., 2:5, :],
                                           is_causal=True)
    assert torch.allclose(out[..., 2:5, :], alone, atol=1e-15)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_the_flexattention_block_mask_is_the_same_attention():
    """document_block_mask for a GPU model's flex_attention: the same outputs as SDPA with
    document_mask (float64; forward only: FlexAttention has no CPU backward in torch 2.13), and
    the blocks no query of a document may see are left out of the kernel's work."""
    from torch.nn.attention.flex_attention import flex_attention

    lengths = [20, 30, 14, 64]  # a window of three documents, then one of a single document
    positions = torch.cat([torch.arange(n) for n in lengths]).view(2, 64)
    q, k, v = (torch.randn(2, 4, 64, 16, dtype=torch.float64) for _ in range(3))
    block_mask = document_block_mask(positions, block_size=16)
    out = flex_attention(q, k, v, block_mask=block_mask)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=document_mask(positions))
    assert (out - want).abs().max() < 1e-13
    # causal alone would keep 10 of the 16 blocks per window; the documents drop 2 of them in
    # the first window (queries 32-63 see none of keys 0-15, all of the first document)
    kept = block_mask.to_dense().sum(dim=(-1, -2)).flatten().tolist()
    assert kept == [8, 10], kept
    # built from each block's first and last document (no L x L mask), the blocks are torch's
    # create_block_mask's, also where the window is not a whole number of blocks
    from torch.nn.attention.flex_attention import create_block_mask

    for cut in (64, 57):
        docs = document_ids(positions[:, :cut])
        ours = document_block_mask(positions[:, :cut], block_size=16)
        theirs = create_block_mask(lambda b, h, q, k: (k <= q) & (docs[b, q] == docs[b, k]),
                                   2, None, cut, cut, device="cpu", BLOCK_SIZE=16)
        assert torch.equal(ours.to_dense(), theirs.to_dense()), cut
        # (the blocks the kernel runs without the mask: the same; past the window's end none)
        whole = ours.full_kv_num_blocks, theirs.full_kv_num_blocks
        assert torch.equal(*whole) if cut == 64 else bool((whole[0] <= whole[1]).all()), whole
        out = flex_attention(q[..., :cut, :], k[..., :cut, :], v[..., :cut, :], block_mask=ours)
        want = F.scaled_dot_product_attention(q[..., :cut, :], k[..., :cut, :], v[..., :cut, :],
                                              attn_mask=document_mask(positions[:, :cut]))
        assert (out - want).abs().max() < 1e-13, cut


def test_a_token_has_zero_gradient_from_earlier_documents():
    model = llama().double()
    ids = packed_docs()[3]
    embeds = model.get_input_embeddings()(ids["input_ids"][None]).detach().requires_grad_(True)
    first, _ = _lengths(3)
    for positions, leaks in ((ids["position_ids"][None], False), (None, True)):
        embeds.grad = None
        logits = model(inputs_embeds=embeds, position_ids=positions).logits
        logits[0, first:].sum().backward()  # the second document's outputs
        earlier = embeds.grad[0, :first]
        assert (earlier.abs().sum() > 0) == leaks  # without positions: one causal window
        assert embeds.grad[0, first:].abs().sum() > 0
    assert torch.count_nonzero(earlier) > 0
    embeds.grad = None
    model(inputs_embeds=embeds, position_ids=ids["position_ids"][None]).logits[0, first:].sum().backward()
    assert torch.count_nonzero(embeds.grad[0, :first]) == 0  # exactly zero, not small


def test_packed_training_equals_training_on_the_documents_one_per_row():
    """20 steps in float64: two packed rows a step against their four documents padded, the
    loss a mean over the same targets: every step's loss and the weights agree."""
    common = dict(max_steps=20, shuffle=False, log_grad_norm=True)
    packed = train_state(dict(common, global_batch_size=2), float64=True, **FNS)
    unpacked = train_state(dict(common, global_batch_size=4), float64=True,
                           **dict(FNS, data_fn=unpacked_docs))
    # (transformers computes the loss in float32 whatever the model: the sum over the tokens,
    # in another order, rounds at 1e-7; each token's gradient is the same)
    assert torch.allclose(packed[LOSSES], unpacked[LOSSES], rtol=1e-6, atol=0)
    start = llama().state_dict()
    assert max((packed[k] - start[k]).abs().max().item() for k in start) > 1e-2  # it trained
    for name, value in params_of(unpacked).items():
        assert torch.allclose(packed[name], value, rtol=1e-12, atol=1e-14), name
    mixed = train_state(dict(common, global_batch_size=2), float64=True,  # positions dropped
                        **dict(FNS, data_fn=without_positions))
    assert not torch.allclose(mixed[LOSSES], unpacked[LOSSES], rtol=1e-4, atol=0)


def without_positions() -> list[dict]:
    return [{k: v for k, v in row.items() if k != "position_ids"} for row in packed_docs()]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout, procs, options", [
    ("dp=2", 2, {}), ("tp=2", 2, {}), ("cp=2", 2, {}), ("pp=2", 2, {"micro_batch_size": 2}),
    ("pp=2", 2, {"micro_batch_size": 1, "parallel_kwargs": dict(
        pp_schedule="interleaved-1f1b", stages_per_rank=2)})],
    ids=["dp=2", "tp=2", "cp=2", "pp=2", "pp=2-interleaved"])
def test_packed_documents_match_one_process(layout, procs, options):
    """Under cp a document crosses the cut between ranks (the zig-zag chunks of 4 tokens):
    the window's document ids (taken before the cut) keep each query in its document. Under pp every stage gets its
    micro-batch's positions (4 micro-batches: a wrong one shows)."""
    assert_parity(layout, procs, steps=6, global_batch_size=8, fns=FNS, **options)
