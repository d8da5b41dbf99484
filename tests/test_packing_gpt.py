"""meshtrain's GPT on packed documents (``GPTConfig.document_eos``): its batches are
(input, target) pairs without positions, so the model finds each document from the eos that
ends it; attention and positions stay inside each document, and training on packed windows is
training on the documents one per row, under zero3, tp (with sequence parallel), cp and pp."""

import pytest
import torch
from parity import LOSSES, adamw_gpt, assert_parity, params_of, train_state

from meshtrain import losses
from meshtrain.models.gpt import GPT, GPTConfig
from meshtrain.packing import document_positions, eos_documents

torch.set_num_threads(1)
SEQ, ROWS, VOCAB = 16, 40, 32
EOS = VOCAB - 1


def gpt(document_eos=EOS):
    return GPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, num_layers=2, num_heads=2, d_model=16,
                         bias=False, document_eos=document_eos))


def documents(row: int) -> list[torch.Tensor]:
    """Two documents of varying lengths filling a window, each ending with the eos."""
    first = 3 + (7 * row) % 11
    ids = torch.randint(0, EOS, (SEQ,), generator=torch.Generator().manual_seed(row))
    ids[first - 1] = ids[-1] = EOS
    return [ids[:first], ids[first:]]


def targets(doc: torch.Tensor) -> torch.Tensor:
    """Each token's next one in its document; none for the eos."""
    return torch.cat([doc[1:], torch.tensor([-100])])


def packed() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.cat(docs), torch.cat([targets(d) for d in docs]))
            for docs in map(documents, range(ROWS))]


def unpacked() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The same documents one per row, padded at the end (no target on the padding)."""
    rows = []
    for row in range(ROWS):
        for doc in documents(row):
            pad = SEQ - len(doc)
            rows.append((torch.nn.functional.pad(doc, (0, pad)),
                         torch.nn.functional.pad(targets(doc), (0, pad), value=-100)))
    return rows


FNS = dict(model_fn=gpt, data_fn=packed, loss_fn=losses.cross_entropy(), optimizer_fn=adamw_gpt)


def test_documents_and_positions_start_after_each_eos():
    ids = torch.tensor([[5, 6, EOS, 1, 2, 3, EOS, 4]])  # the window begins inside a document
    docs = eos_documents(ids, EOS)
    assert docs.tolist() == [[0, 0, 0, 1, 1, 1, 1, 2]]
    assert document_positions(docs).tolist() == [[0, 1, 2, 0, 1, 2, 3, 0]]


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_each_document_of_a_window_computes_as_if_alone(monkeypatch):
    from meshtrain.models import gpt_attention

    model = gpt().double()
    first, second = documents(5)
    window = model(torch.cat([first, second])[None])[0]
    assert (window[:len(first)] - model(first[None])[0]).abs().max() < 1e-13
    assert (window[len(first):] - model(second[None])[0]).abs().max() < 1e-13
    # FlexAttention with the documents' BlockMask (a GPU's default; on a CPU forward only)
    # computes what the SDPA boolean mask does
    for layer in model.layers:
        layer.attn.flex_documents = True
    kernel, calls = gpt_attention._flex_attention, []
    monkeypatch.setattr(gpt_attention, "_flex_attention",
                        lambda device: calls.append(device) or kernel(device))
    with torch.no_grad():
        flex = model(torch.cat([first, second])[None])[0]
    assert (flex - window).abs().max() < 1e-13 and len(calls) == 2  # (each layer's)
    plain = gpt(document_eos=None).double()  # one causal window: the second sees the first
    mixed = plain(torch.cat([first, second])[None])[0, len(first):]
    assert (mixed - plain(second[None])[0]).abs().max() > 1e-3


def test_packed_training_equals_training_on_the_documents_one_per_row():
    """20 steps in float64: two packed windows a step against their four documents padded, the
    loss a mean over the same targets: every step's loss and the weights agree."""
    common = dict(max_steps=20, shuffle=False, log_grad_norm=True)
    packed_run = train_state(dict(common, global_batch_size=2), float64=True, **FNS)
    rows = train_state(dict(common, global_batch_size=4), float64=True,
                       **dict(FNS, data_fn=unpacked))
    assert torch.allclose(packed_run[LOSSES], rows[LOSSES], rtol=1e-12, atol=0)
    start = gpt().state_dict()
    assert max((packed_run[k] - start[k]).abs().max().item() for k in start) > 1e-2
    for name, value in params_of(rows).items():
        assert torch.allclose(packed_run[name], value, rtol=1e-10, atol=1e-13), name
    mixed = train_state(dict(common, global_batch_size=2), float64=True,
                        **dict(FNS, model_fn=lambda: gpt(document_eos=None)))
    assert not torch.allclose(mixed[LOSSES], rows[LOSSES], rtol=1e-4, atol=0)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout, options", [
    ("zero3=2", {}), ("tp=2", {}), ("tp=2", {"parallel_kwargs": {"sequence_parallel": True}}),
    ("cp=2", {}),
    ("pp=2", {"micro_batch_size": 2}),
    ("pp=2", {"micro_batch_size": 2, "activation_checkpointing": "full"})],
    ids=["zero3=2", "tp=2", "tp=2-sp", "cp=2", "pp=2", "pp=2-checkpointed"])
def test_packed_documents_match_one_process(layout, options):
    """Under cp each rank holds two chunks of 4 tokens (zig-zag), and documents cross the cut:
    the window's documents are found before the cut. Under pp every stage's blocks get their
    micro-batch's document ids (4 micro-batches: a wrong one shows), also when recomputed in
    backward (1F1B runs the next micro-batch's forward before it)."""
    assert_parity(layout, 2, steps=6, global_batch_size=8, fns=FNS, **options)
