"""Before any process starts: do the pipeline stages compute the model's own ``forward``?

:func:`~meshtrain.parallel.pipeline.split_model` gives every stage the conventional forward:
the first stage runs ``model.embed(x)``, each stage its run of ``model.layers`` (every block
called with the hidden state alone), the last stage ``model.norm`` then ``model.head`` (those
present); an ``nn.Sequential`` runs its children in order. Whatever else the model's own
``forward`` does (a learned positional term added after the embedding, logits projected through
the embedding's weight, a scale, a mask, a tuple returned) the stages would not do: shapes that
happen to fit would train a different function silently.

:func:`check_stage_forward` runs that composition in one process on a sample batch, beside
``model(x)``, and refuses with a :class:`ConfigError` when the outputs differ (type, shape, max
absolute difference). A ``TorchFunctionMode`` records which parameters every op takes and where
(before the first block, inside block ``i``, between blocks, after the last block), so the
message names the cause: parameters that ``forward`` uses and the stages never would, weights
shared across stages (one Parameter used in two places: ``h @ self.embed.weight.T`` after the
last block, where the last stage does not hold the embedding; a weight shared by a block and
another stage's module), and a parameter used in one place only, where the stage that
holds it does not run (a head module named ``fc``: the first stage holds it). A weight the
stages themselves use before the first block and after the last (a head module tied to the
embedding) passes: the first and last stage each hold a copy (pipeline/tied.py).

A model pipelined by an adapter (``PipelineOptions.adapter``, e.g. a Hugging Face model) is
checked the same way with the adapter's composition (``adapter.stage_forward``) against
``adapter.model_output(model(x))``, on ``adapter.example_inputs(model)`` when the samples are
not (inputs, targets) pairs.
"""

from __future__ import annotations

import itertools
import math

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves, tree_map

from meshtrain.check_skips import skipped
from meshtrain.errors import ConfigError
from meshtrain.parallel.pipeline.stages import _POST, pipeline_blocks

#: a factory's model is built for real (once, before the processes) up to this many parameter
#: elements; a larger one is checked on its meta-device copy, each op given real stand-ins of
#: the tensors it takes (stand_ins.py), on one sample of at most CHECK_TOKENS tokens
BUILD_LIMIT = 2**27
CHECK_TOKENS = 64
PRE, POST = (-1,), (math.inf,)  # regions of forward, ordered: PRE < (2i,) block i < POST


def _block(i: int) -> tuple:
    return (2 * i,)


def _between(i: int) -> tuple:  # after block i, before block i + 1
    return (2 * i + 1,)


def _is_between(region: tuple) -> bool:
    return region not in (PRE, POST) and int(region[0]) % 2 == 1


def _where(region: tuple) -> str:
    """Where in forward an op ran (a region)."""
    if region == PRE:
        return "before the first block (on the first stage)"
    if region == POST:
        return "after the last block (on the last stage)"
    i, between = divmod(int(region[0]), 2)
    return f"between blocks {i} and {i + 1}" if between else f"inside block {i}"


def _holder(region: tuple) -> str:
    """Which stage holds a parameter registered in ``region``."""
    if region == PRE:
        return "the first stage (embed)"
    if region == POST:
        return "the last stage (norm/head)"
    return f"the stage of block {int(region[0]) // 2}"


def stage_forward(model: nn.Module, x):
    """What the stages of ``split_model`` compute one after another, run on the whole model."""
    if isinstance(model, nn.Sequential):
        for child in model:
            x = child(x)
        return x
    side = getattr(model, "pipeline_side_inputs", None)  # (what every stage reads besides)
    extra = (side(x) if callable(side) else None) or {}
    if callable(getattr(model, "embed", None)):
        x = model.embed(x, **extra)
    for block in pipeline_blocks(model):
        x = block(x, **extra)
    for name in _POST:
        if getattr(model, name, None) is not None:
            x = getattr(model, name)(x)
    return x


class _UseRecorder(TorchFunctionMode):
    """Which parameters each op takes, by the region of forward the op runs in (block hooks
    move the region along)."""

    def __init__(self, params: dict[int, nn.Parameter], blocks: list[nn.Module],
                 stand_ins=None):
        super().__init__()
        self.params, self.region, self.uses = params, PRE, {}
        self.stand_ins = stand_ins  # a meta model's tensors: real values for each op
        last = len(blocks) - 1
        self.handles = [h for i, block in enumerate(blocks) for h in (
            block.register_forward_pre_hook(lambda *_, i=i: self._move(_block(i))),
            block.register_forward_hook(
                lambda *_, i=i: self._move(POST if i == last else _between(i))))]

    def _move(self, region: tuple) -> None:
        self.region = region

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for leaf in tree_leaves((args, kwargs)):
            if isinstance(leaf, torch.Tensor) and id(leaf) in self.params:
                self.uses.setdefault(id(leaf), set()).add(self.region)
        if self.stand_ins is not None:
            real = self.stand_ins
            args, kwargs = tree_map(lambda t: real.real(t) if t in real else t, (args, kwargs))
        return func(*args, **kwargs)

    def take(self) -> dict[int, set]:
        """The uses recorded since the last call; the next run starts before the first block."""
        uses, self.uses, self.region = self.uses, {}, PRE
        return uses


def _owners(model: nn.Module, blocks: list[nn.Module],
            post: tuple[str, ...] = _POST) -> tuple[dict, dict]:
    """Each parameter's names (``a.weight = b.weight`` when shared) and the region of the stage
    that holds it, from the first name it is registered under (inside a block: that block's;
    under a module named in ``post``: the last stage's; else the first stage's)."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    keys = {id(block): i for i, block in enumerate(blocks)}
    index = {f"{name}.": _block(keys[id(module)]) for name, module in model.named_modules()
             if id(module) in keys}
    owner = {}
    for pid, found in names.items():
        region = next((r for prefix, r in index.items() if found[0].startswith(prefix)), None)
        if region is None:
            region = POST if any(found[0].startswith(f"{p}.") for p in post) else PRE
        owner[pid] = region
    return {pid: " = ".join(n) for pid, n in names.items()}, owner


def _output_finding(expected, got) -> str | None:
    """How the stages' output differs from ``model(x)``'s, or None."""
    if not isinstance(expected, torch.Tensor):
        return (f"model.forward returns a {type(expected).__name__}; the last stage's output "
                f"goes to loss_fn(output, targets) as one tensor")
    if not isinstance(got, torch.Tensor):
        return f"the stages return a {type(got).__name__}, model.forward a tensor"
    if got.shape != expected.shape:
        return (f"the outputs differ in shape: model(x) gives {tuple(expected.shape)}, the "
                f"stages {tuple(got.shape)}")
    want, have = expected.double(), got.double()
    diff = torch.where(want.isnan() & have.isnan(), 0.0, (have - want).abs()).nan_to_num(math.inf)
    worst = diff.max().item() if diff.numel() else 0.0
    finite = want[want.isfinite()]
    scale = 1 + (finite.abs().max().item() if finite.numel() else 0.0)
    eps = torch.finfo(expected.dtype).eps if expected.is_floating_point() else 0.0
    if worst <= max(1e-5, 16 * eps) * scale:
        return None
    return (f"the outputs differ: max |difference| {worst:.3g} between model(x) and the stages' "
            f"output (both of shape {tuple(expected.shape)})")


def check_stage_forward(model: nn.Module, inputs: torch.Tensor, adapter=None) -> None:
    """Refuse (ConfigError) when the pipeline stages of ``model``, composed in one process, do
    not compute ``model(inputs)``: different outputs, parameters only one of them uses, or a
    weight used where the stage holding it does not run. Runs in eval mode without gradients
    and leaves the model (and the CPU RNG) as it was. On a meta-device model only uses and
    shapes are compared; when ``model(inputs)`` itself fails, or the stages need a value that a
    meta tensor does not have, nothing can be compared and nothing is refused. ``adapter``: see
    the module's doc."""
    blocks = adapter.blocks(model) if adapter is not None else pipeline_blocks(model)
    first = next(itertools.chain(model.parameters(), model.buffers()), None)
    device = first.device if first is not None else torch.device("cpu")
    on_meta = device.type == "meta"
    if on_meta:  # real values, a few tensors at a time, on one short sample (at any size)
        from meshtrain.parallel.pipeline.stand_ins import StandIns

        inputs = inputs[:1, :CHECK_TOKENS] if inputs.dim() >= 2 else inputs[:1]
    else:
        inputs = inputs.to(device)
    params = {id(p): p for p in model.parameters()}
    names, owner = _owners(model, blocks, *([adapter.post_modules] if adapter else []))
    modes = {module: module.training for module in model.modules()}
    recorder = _UseRecorder(params, blocks, StandIns(model) if on_meta else None)
    failure = got = None
    try:
        model.eval()
        # (a meta model: new tensors on the CPU beside the stand-ins, whatever the default)
        with torch.no_grad(), torch.random.fork_rng(devices=[]), \
                torch.device("cpu" if on_meta else device), recorder:
            try:
                expected = model(inputs)
                expected = adapter.model_output(expected) if adapter is not None else expected
            except Exception as error:  # noqa: BLE001 - not this check's to report (the data?)
                skipped("pipeline check", f"{type(model).__name__}'s forward failed on a "
                        f"training sample{' on the meta device' if on_meta else ''} "
                        f"({type(error).__name__}: {str(error)[:200]}), so its stages were "
                        "not compared with model(x) before start")
                return
            model_uses = recorder.take()
            try:
                got = (adapter.stage_forward if adapter is not None else stage_forward)(
                    model, inputs)
            except Exception as error:  # noqa: BLE001 - reported below
                failure = error
            stage_uses = recorder.take()
    finally:
        for handle in recorder.handles:
            handle.remove()
        for module, mode in modes.items():
            module.training = mode
        if on_meta:
            from meshtrain.parallel.pipeline.stand_ins import trim_heap

            recorder.stand_ins = None  # (its cache's tensors freed, then handed back)
            trim_heap()
    if on_meta and failure is not None and "meta tensors" in str(failure):
        skipped("pipeline check", f"the stages of {type(model).__name__} need a value (an "
                ".item()) that its meta-device copy has not, so they were not compared with "
                "model(x) before start")
        return
    findings, shared = [], []
    for pid in dict.fromkeys(itertools.chain(model_uses, stage_uses)):
        used = model_uses.get(pid, set()) | stage_uses.get(pid, set())
        for region in sorted(r for r in used if _is_between(r)):
            findings.append(f"{names[pid]} is used {_where(region)}, where no stage runs "
                            f"anything")
        regions = sorted(r for r in used if not _is_between(r))
        elsewhere = [r for r in regions if r != owner[pid]]
        if regions == [PRE, POST] and {PRE, POST} <= stage_uses.get(pid, set()):
            continue  # tied between the first and the last stage, as the stages use it: tied.py
        if len(regions) > 1:  # one Parameter used in two regions: by two stages
            shared += [f"{names[pid]} is held by {_holder(owner[pid])} but also used "
                       f"{_where(region)}: a weight shared across stages" for region in elsewhere]
        elif elsewhere:  # used in one place only, which is not where its stage runs
            findings.append(_misplaced(names[pid], owner[pid], elsewhere[0], adapter is None))
    for what, ours, theirs in (("model.forward uses parameters the stages never use",
                                model_uses, stage_uses),
                               ("the stages use parameters model.forward does not",
                                stage_uses, model_uses)):
        missing = [names[pid] for pid in ours if pid not in theirs]
        if missing:
            findings.append(f"{what}: {', '.join(missing)}")
    if failure is not None:
        findings.append(f"the stages fail where model(x) runs: {type(failure).__name__}: "
                        f"{failure}")
    elif (finding := _with_cpu(on_meta, _output_finding, expected, got)) is not None:
        findings.append(finding)
    findings = shared + findings
    if findings and callable(getattr(adapter, "suspects", None)):  # (the likely cause first)
        findings = adapter.suspects(model) + findings
    if findings:
        raise ConfigError(_message(type(model).__name__, len(inputs), findings, bool(shared),
                                   getattr(adapter, "stages_doc", None)))


def _with_cpu(on_meta: bool, fn, *args):
    if not on_meta:
        return fn(*args)
    with torch.device("cpu"):
        return fn(*args)


def _misplaced(name: str, owner: tuple, region: tuple, conventional: bool) -> str:
    """A parameter used in one region only, not the one of the stage that holds it (a head
    module that is not named ``head``, so the first stage holds it)."""
    text = f"{name} is used {_where(region)} only, but the stages hold it on {_holder(owner)}"
    if conventional and region == POST:
        return (text + ": after the last block they run model.norm and model.head alone, and "
                "its module is neither; make it model.head (with what forward computes there, "
                "e.g. a mean over the sequence, inside it)")
    if conventional and region == PRE:
        return text + ": before the first block they run model.embed alone; make it part of it"
    return text + ", where it is not used"


def _message(model_name: str, num_samples: int, findings: list[str], shared: bool,
             stages_doc: str | None = None) -> str:
    lines = "".join(f"\n  - {line}" for line in findings)
    untie = ("\nA pipeline stage holds its own copy of every weight it uses, so a weight used "
             "by two stages would be two weights drifting apart: untie it (give the output "
             "projection its own weight, head = nn.Linear(d_model, vocab, bias=False)), or "
             "train without pp." if shared else "")
    return (
        f"the pipeline stages of {model_name} would not compute its forward (checked in one "
        f"process on {num_samples} sample(s)):{lines}{untie}\n" + (stages_doc or
        "The stages run model.embed(x) (a module or method: everything before the first "
        "block), then the blocks of model.layers in order, each called with the hidden state "
        "alone, then model.norm and model.head (everything after the last block); an "
        "nn.Sequential runs its children in order. Restructure the model so that this is "
        "exactly its forward (e.g. add a positional term inside embed: def embed(self, idx): "
        "return self.tok(idx) + self.pos; project the output in a head module; nothing between "
        "blocks), or train it without pp."))


def model_for_check(model: nn.Module | None, original) -> nn.Module | None:
    """The model to check: the user's module itself; a factory's model built for real (on
    whatever device the factory picks, under a forked RNG) when its meta-device copy ``model``
    has at most :data:`BUILD_LIMIT` parameter elements, else that copy; None without either."""
    on_meta = model is not None and any(p.is_meta for p in model.parameters())
    if model is not None and not on_meta:
        return model
    if isinstance(original, nn.Module) or not callable(original) or (
            model is not None and sum(p.numel() for p in model.parameters()) > BUILD_LIMIT):
        return model
    try:
        with torch.random.fork_rng(devices=[]):
            built = original()
    except Exception:  # noqa: BLE001 - built again (and failing there) on every rank later
        return model
    return built if isinstance(built, nn.Module) else model


def check_before_start(model: nn.Module | None, original, sample_inputs, adapter=None) -> None:
    """:func:`check_stage_forward` on the model (see :func:`model_for_check`) and the inputs
    ``sample_inputs()`` gives: the first training samples, as long as training makes them (a
    forward that differs only past some length, such as a sliding window, shows); a dict batch
    split by the adapter; without samples an adapter's ``example_inputs``, else nothing is
    checked."""
    checked = model_for_check(model, original)
    if checked is None:
        skipped("pipeline check", "the model could not be built before start, so its stages "
                "were not compared with its forward")
        return
    why = "its inputs are not a tensor"
    try:
        inputs = sample_inputs()
        if isinstance(inputs, dict):
            inputs = adapter.split_batch(inputs)[0] if adapter is not None else None
    except Exception as error:  # noqa: BLE001 - samples the stack cannot batch: nothing to check on
        inputs, why = None, f"they cannot be batched ({type(error).__name__})"
    if inputs is None and adapter is not None:
        inputs = adapter.example_inputs(checked)
    if isinstance(inputs, torch.Tensor):
        check_stage_forward(checked, inputs, *([adapter] if adapter is not None else []))
    else:
        skipped("pipeline check", f"no training sample to run {type(checked).__name__} on "
                f"before start ({why}), so its stages were not compared with its forward")
