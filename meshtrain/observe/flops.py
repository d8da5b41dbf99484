"""Model FLOPs per token (or sample) and the peak they are compared with: model FLOPs
utilisation (MFU) = achieved model FLOP/s per rank / that peak.

* FLOPs per item: a model's own ``flops_per_token()`` when it has one (meshtrain's GPT and
  Llama add attention's 12·L·d·T); else counted by torch's ``FlopCounterMode`` over one
  forward and backward of a meta-device copy on the shapes of rank 0's first training batch
  (matmuls, attention, convolutions; nothing computed: :class:`FirstBatchCount`, which the
  Trainer runs at its first logging interval), divided by the batch's tokens (integer inputs)
  or samples; a forward that reads values on meta (transformers' packed-sequence check) is
  counted again under ``FakeTensorMode``, where such code takes its tracing path; else (a
  forward that needs real values, a ``training_step`` of its own) 6 × its active parameters
  outside embedding tables (a forward multiply-add per parameter per token is 2 FLOPs, its
  backward 4; an embedding is a lookup). These are the model's FLOPs: recomputation
  (activation checkpointing) and padding do not count, as in PaLM's MFU.
* Mixture of experts: a token runs k of a layer's E experts, so the experts count k/E of
  their parameters (active parameters). A Hugging Face model's fused experts ([E, ...]
  parameters, called with each token's top-k indices: transformers 5) loop over the experts
  hit with ``.nonzero()``, which no meta count can run: in the count their call adds
  6 x tokens x k x one expert's parameters instead (:func:`expert_modules`).
* The peak per device: the ``peak_tflops`` setting; else a GPU's dense bf16 peak from
  :data:`GPU_PEAK_TFLOPS`; else (CPU) a float32 matmul measured once in the process with its
  threads (what a rank can reach here, not a data-sheet number).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import time

import torch

# dense (not sparse) bf16 tensor-core peaks, TFLOP/s, from NVIDIA's data sheets; the first
# name contained in torch.cuda.get_device_name() wins
GPU_PEAK_TFLOPS = (("H200", 989.4), ("H100 PCIe", 756.0), ("H100", 989.4), ("B200", 2250.0),
                   ("A100", 312.0), ("L40S", 362.0), ("A10G", 70.0))


def count_flop_params(model: torch.nn.Module) -> int:
    """Parameters that take part in matmuls: all but embedding tables (counted once when
    shared, e.g. tied weights; a meta or sharded model counts its full shapes)."""
    embedding = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) in seen or id(p) in embedding:
            continue
        seen.add(id(p))
        total += p.numel()
    return total


def expert_modules(model: torch.nn.Module) -> list[tuple[torch.nn.Module, int]]:
    """A model's experts as (module holding their weights, k: the experts a token runs):
    a module named ``experts`` or with an int ``num_experts`` whose own parameters are all
    [E, ...] alike, some 3-D (meshtrain's GroupedExperts; transformers' fused experts; not a
    router's [E, d]), beside a router
    with an int ``top_k`` (else k is the config's ``num_experts_per_tok``). Under ep a rank
    holds some rows of each: what one expert holds is still a row."""
    config_k = getattr(getattr(model, "config", None), "num_experts_per_tok", None)
    found = []
    for parent in model.modules():
        children = dict(parent.named_children())
        k = next((c.top_k for c in children.values()
                  if isinstance(getattr(c, "top_k", None), int)), config_k)
        for name, child in children.items():
            own = list(child.parameters(recurse=False))
            if not isinstance(k, int) or not own or not (
                    name == "experts" or isinstance(getattr(child, "num_experts", None), int)):
                continue
            if all(p.dim() >= 2 and p.shape[0] == own[0].shape[0] > 1 for p in own) and \
                    any(p.dim() >= 3 for p in own):
                found.append((child, k))
    return found


def active_flop_params(model: torch.nn.Module) -> float:
    """:func:`count_flop_params` with each expert layer's weights counted for the k experts a
    token runs (k/E of them: active parameters); all of them for a model without experts."""
    inactive = 0.0
    for module, k in expert_modules(model):
        own = list(module.parameters(recurse=False))
        rows = own[0].shape[0]
        inactive += sum(p.numel() for p in own) * (1 - min(k, rows) / rows)
    return count_flop_params(model) - inactive


def flops_per_item(model: torch.nn.Module, seq_len: int | None = None, *,
                   meta_model: torch.nn.Module | None = None, sample=None) -> float:
    """Model FLOPs (forward + backward) per token, or per sample for other inputs: the model's
    own count, else counted on ``meta_model`` (a meta-device copy) with ``sample`` (the first
    training inputs: a tensor or a dict of them), else 6 × the active matmul parameters."""
    own = getattr(model, "flops_per_token", None)
    if callable(own):
        return float(own(seq_len))
    counted = counted_flops_per_item(meta_model, sample) if meta_model is not None else None
    return counted if counted is not None else 6.0 * active_flop_params(model)


def counted_flops_per_item(meta_model: torch.nn.Module, sample) -> float | None:
    """``FlopCounterMode``'s count of one forward and backward of ``meta_model`` on ``sample``
    (moved to the meta device) per token (integer inputs) or sample; None when it cannot run
    (no sample, an output without a tensor, a forward that needs real values)."""
    from torch.utils._pytree import tree_map

    if sample is None:
        return None
    inputs = tree_map(lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t, sample)
    counted = _count(meta_model, inputs)
    if counted is None and isinstance(inputs, dict) and "attention_mask" in inputs:
        # a padding mask's code reads its values (transformers checks whether it masks
        # anything); SDPA over the whole length costs the same FLOPs with it or without
        counted = _count(meta_model, {k: v for k, v in inputs.items() if k != "attention_mask"})
    return counted


def _count(meta_model: torch.nn.Module, inputs) -> float | None:
    from torch.utils._pytree import tree_leaves

    first = next((t for t in tree_leaves(inputs) if isinstance(t, torch.Tensor)), None)
    if first is None or first.dim() == 0:
        return None
    items = first.numel() if not first.is_floating_point() and first.dim() == 2 else len(first)
    # a torch.compile'd model (the user's OptimizedModule) counted eagerly: the same FLOPs,
    # without compiling a meta graph (or torch's warning about the counter's global hooks)
    meta_model = getattr(meta_model, "_orig_mod", meta_model)
    experts, total = ExpertFlops(meta_model), None
    try:
        for fake in (False, True):  # on meta; then faked (code reading values: its trace path)
            experts.flops = 0.0
            total = _run_counted(meta_model, inputs, fake)
            if total is not None:
                break
    finally:
        experts.restore()
    total = None if total is None else total + experts.flops
    return float(total) / items if total else None


def _run_counted(meta_model: torch.nn.Module, inputs, fake: bool) -> float | None:
    """FLOPs of one forward and backward of ``meta_model`` on ``inputs`` (meta tensors), under
    ``FakeTensorMode`` when ``fake``; None when it cannot run."""
    from torch.utils._pytree import tree_leaves, tree_map
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    was_training = meta_model.training
    try:
        with contextlib.ExitStack() as stack:
            if fake:
                from torch._subclasses.fake_tensor import FakeTensorMode

                stack.enter_context(_quiet("torch._subclasses.fake_tensor"))  # (its failures)
                mode = stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
                inputs = tree_map(lambda t: mode.from_tensor(t) if isinstance(t, torch.Tensor)
                                  else t, inputs)
            stack.enter_context(counter)
            stack.enter_context(torch.device("meta"))
            meta_model.train()
            out = meta_model(**inputs) if isinstance(inputs, dict) else meta_model(inputs)
            out = getattr(out, "logits", out)
            tensor = next((t for t in tree_leaves(out) if isinstance(t, torch.Tensor)
                           and t.is_floating_point() and t.requires_grad), None)
            if tensor is None:
                return None
            tensor.float().sum().backward()
    except Exception:  # noqa: BLE001 - an estimate: 6 x parameters then
        return None
    finally:
        meta_model.train(was_training)
        meta_model.zero_grad(set_to_none=True)
    return float(counter.get_total_flops())


@contextlib.contextmanager
def _quiet(name: str):
    """The logger ``name`` silent inside (torch logs each op that fails on fake tensors)."""
    logger = logging.getLogger(name)
    was = logger.disabled
    logger.disabled = True
    try:
        yield
    finally:
        logger.disabled = was


class ExpertFlops:
    """While a count runs: each of a model's fused experts (:func:`expert_modules` called
    ``(hidden_states [N, d], top_k_index [N, k], top_k_weights [N, k])``: transformers 5's
    experts) computes nothing and adds ``6 x N x k x`` one expert's parameters to ``flops``
    (its forward and backward on the k experts each token runs); its output, the input
    scaled by the router weights, keeps the router in the backward. Another call runs the
    experts' own forward (meshtrain's MoE is counted as it runs: balanced on meta)."""

    def __init__(self, model: torch.nn.Module):
        self.flops, self._replaced = 0.0, []
        for module, _ in expert_modules(model):
            if "forward" in vars(module) or not hasattr(module, "num_experts"):
                continue  # (meshtrain's experts; or a forward replaced already)
            own = list(module.parameters(recurse=False))
            per_expert = sum(p.numel() for p in own) / own[0].shape[0]
            self._replaced.append(module)
            module.forward = self._stand_in(module.forward, per_expert)

    def _stand_in(self, forward, per_expert: float):
        def counted(*args, **kwargs):
            hidden_states, top_k_index, top_k_weights = (*args, None, None, None)[:3]
            if len(args) != 3 or kwargs or not isinstance(top_k_index, torch.Tensor) or \
                    top_k_index.is_floating_point() or top_k_index.dim() != 2 or \
                    not isinstance(top_k_weights, torch.Tensor) or \
                    top_k_weights.shape != top_k_index.shape or hidden_states.dim() != 2:
                return forward(*args, **kwargs)
            rows, k = top_k_index.shape
            self.flops += 6.0 * rows * k * per_expert
            return hidden_states * top_k_weights.sum(-1, keepdim=True).to(hidden_states.dtype)

        return counted

    def restore(self) -> None:
        for module in self._replaced:
            del module.forward  # (the class's again)
        self._replaced = []


class FirstBatchCount:
    """The count of :func:`counted_flops_per_item` for a model that states none, on the shapes of
    the first training batch: :meth:`see` keeps that batch's inputs as meta tensors (no values
    held), :meth:`count` runs the meta copy built from ``template`` (the Trainer's
    ``_whole_template``: a factory, called on the meta device, or a skeleton of the model,
    copied) once. The copy runs the user's forward a second time, on no data: a forward that
    needs values gives None (the caller keeps 6 × parameters)."""

    def __init__(self, template):
        self.template, self.sample, self.done = template, None, False

    def see(self, batch) -> None:
        from torch.utils._pytree import tree_map

        if self.sample is None and not self.done:
            inputs = (batch if isinstance(batch, dict) else batch[0]
                      if isinstance(batch, (tuple, list)) and len(batch) == 2 else None)
            meta = tree_map(lambda t: torch.empty_like(t, device="meta")
                            if isinstance(t, torch.Tensor) else t, inputs)
            self.sample, self.done = meta, inputs is None

    def count(self) -> float | None:
        """FLOPs per item, once (None: no batch seen yet, or not countable)."""
        if self.done or self.sample is None:
            return None
        self.done = True
        # (mid-run on rank 0: a factory that seeds must not move the stream dropout draws from)
        with torch.random.fork_rng(devices=[]):
            try:
                if isinstance(self.template, torch.nn.Module):
                    model = copy.deepcopy(self.template).to("meta")
                else:
                    with torch.device("meta"):
                        model = self.template()
            except Exception:  # noqa: BLE001 - an estimate: 6 x parameters then
                return None
            if not isinstance(model, torch.nn.Module):
                return None
            return counted_flops_per_item(model, self.sample)


@functools.cache
def measured_cpu_peak(threads: int, seconds: float = 0.05, size: int = 512) -> float:
    """TFLOP/s of float32 ``size`` × ``size`` matmuls on this process's ``threads`` (the
    current count; measured once per process and count)."""
    gen = torch.Generator().manual_seed(0)  # not the global RNG: training's dropout uses it
    a, b = torch.randn(size, size, generator=gen), torch.randn(size, size, generator=gen)
    out = torch.empty(size, size)
    torch.mm(a, b, out=out)  # warm
    count, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        torch.mm(a, b, out=out)
        count += 1
    return 2 * size**3 * count / elapsed / 1e12


def peak_tflops(device: torch.device | str, override: float | None) -> tuple[float, str]:
    """(peak TFLOP/s of one device, where the number comes from)."""
    if override is not None:
        return float(override), "the peak_tflops setting"
    device = torch.device(device)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, value in GPU_PEAK_TFLOPS:
            if key in name:
                return value, f"{name}: dense bf16 peak from the data sheet"
        peak = measured_gpu_peak(device)
        return peak, f"{name}: not in the table; a bf16 matmul measured on rank 0"
    threads = torch.get_num_threads()
    return measured_cpu_peak(threads), (f"CPU: a float32 matmul measured on rank 0 with its "
                                 f"{threads} thread{'s' * (threads > 1)} (each rank has as many)")


def measured_gpu_peak(device: torch.device, size: int = 4096, repeats: int = 20) -> float:
    """TFLOP/s of bf16 matmuls on a GPU that is not in the table."""
    a = torch.ones(size, size, device=device, dtype=torch.bfloat16)  # (the RNG left alone)
    torch.mm(a, a)
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        torch.mm(a, a)
    torch.cuda.synchronize(device)
    return 2 * size**3 * repeats / (time.perf_counter() - start) / 1e12


def mfu(flops_per_item_: float, items_per_s: float, num_ranks: int,
        peak: float) -> tuple[float, float]:
    """(achieved model TFLOP/s per rank, MFU) for ``items_per_s`` over the whole job."""
    achieved = flops_per_item_ * items_per_s / num_ranks / 1e12
    return achieved, achieved / peak if peak > 0 else 0.0
