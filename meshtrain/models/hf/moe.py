"""A Hugging Face mixture-of-experts model's router loss, carried by meshtrain.

With ``config.output_router_logits`` transformers' MoE causal LMs return cross-entropy plus
``router_aux_loss_coef`` x the load-balancing loss of the tokens of that one forward. meshtrain
asks the model for its cross-entropy alone (``output_router_logits=False`` at the call),
records each router's logits with a forward hook on the router class the model itself declares
(``_can_record_outputs["router_logits"]``), and adds the balancing loss of the whole
micro-step, every data-parallel rank's tokens together (meshtrain.moe.balance): one process
given the global batch computes what plain transformers computes, and so does every layout.
Before start the model's own ``load_balancing_loss_func`` is compared with meshtrain's on
random logits: a transformers that changed it is refused rather than trained differently.
With or without that loss the routers' picks are counted for the expert load
(models/hf/moe_metrics.py).
"""

from __future__ import annotations

import contextlib
import sys

import torch

from meshtrain.errors import ConfigError
from meshtrain.models.hf.moe_metrics import HFRouterCounts, RouterPicks
from meshtrain.moe import grouped
from meshtrain.moe.balance import RouterStats, balance_term, router_stats


class HFRouterLoss:
    """What the Engine asks of a model's router loss (see meshtrain.moe.balance): ``coef``, the
    keyword arguments of the model's call, ``recording()`` around a forward, ``stats(batch)``
    of the forward recorded last; the routers' picks of each step (``after_step``: the expert
    load)."""

    call_kwargs = {"output_router_logits": False}
    field = "config.output_router_logits"  # what turns it on, for a refusal

    def __init__(self, model: torch.nn.Module):
        config = model.config
        self.coef = float(config.router_aux_loss_coef)
        self.num_experts, self.top_k = int(model.num_experts), int(model.num_experts_per_tok)
        recorder = router_recorder(model)
        self._index, self._sink, self._recorded = recorder.index or 0, None, []
        self.routers = [m for m in model.modules() if isinstance(m, recorder.target_class)]
        for router in self.routers:  # recomputed forwards (activation checkpointing) not kept
            router.register_forward_hook(self._keep)
        self.picks = RouterPicks(self.routers, self.num_experts, self.top_k, self._index)

    def _keep(self, module, args, output) -> None:
        if self._sink is not None:
            self._sink.append(output[self._index] if isinstance(output, (tuple, list))
                              else output)

    @contextlib.contextmanager
    def recording(self):
        self._sink = []
        try:
            with self.picks.recorded():
                yield
        finally:
            self._recorded, self._sink = self._sink, None

    @property
    def counted_layers(self) -> int:
        return len(self.routers)

    def after_step(self, group=None) -> torch.Tensor:
        """Once a step: the step's picks [routers, E] summed over ``group``."""
        return self.picks.after_step(group)

    def stats(self, batch) -> RouterStats:
        mask = batch.get("attention_mask") if isinstance(batch, dict) else None
        if len(self._recorded) != len(self.routers):
            raise AssertionError(f"recorded {len(self._recorded)} routers of "
                                 f"{len(self.routers)}")
        return router_stats(self._recorded, self.num_experts, self.top_k, mask)


class HFBiasBalance:
    """Auxiliary-loss-free balancing for a transformers MoE model whose routers carry an
    ``e_score_correction_bias`` (DeepSeek-V3 and its kin): transformers picks experts with it
    but never moves it. With ``config.router_bias_rate`` > 0 meshtrain moves it once a step as
    it moves its own MoE's bias (meshtrain.moe.layer): ``bias += rate * sign(mean - count)``,
    from each router's picks in the step's training forwards (its output's last element, the
    top-k indices) summed over the data- and context-parallel ranks, so every layout moves it
    alike. No loss is added."""

    call_kwargs: dict = {}
    field = "config.router_bias_rate"
    coef = 0.0

    def __init__(self, model: torch.nn.Module, routers: list, rate: float):
        self.routers, self.rate = routers, rate
        self.num_experts = routers[0].e_score_correction_bias.numel()
        self._counts: torch.Tensor | None = None
        self._recording = False  # (forwards recomputed in the backward are not counted)
        for index, router in enumerate(routers):
            router.register_forward_hook(
                lambda module, args, output, index=index: self._count(index, output))

    def _count(self, index: int, output) -> None:
        if not self._recording:
            return
        picks = output[-1] if isinstance(output, (tuple, list)) else None
        if picks is None or picks.is_floating_point():
            raise ConfigError(f"{self.field}: the router {type(self.routers[index]).__name__} "
                              "did not return its top-k expert indices last; meshtrain cannot "
                              "count its picks. Unset router_bias_rate")
        if self._counts is None:
            self._counts = torch.zeros(len(self.routers), self.num_experts, dtype=torch.float64,
                                       device=picks.device)
        self._counts[index] += expert_counts(picks.reshape(-1), self.num_experts)

    @contextlib.contextmanager
    def recording(self):
        self._recording = True
        try:
            yield
        finally:
            self._recording = False

    @property
    def counted_layers(self) -> int:
        """The rows of :meth:`after_step`'s counts: one per router."""
        return len(self.routers)

    @torch.no_grad()
    def after_step(self, group=None) -> torch.Tensor:
        """Once per optimizer step: the step's picks [routers, E] summed over ``group``, each
        router's bias moved by them; returns the counts."""
        counts = self._counts if self._counts is not None else torch.zeros(
            len(self.routers), self.num_experts, dtype=torch.float64,
            device=self.routers[0].e_score_correction_bias.device)
        if group is not None and torch.distributed.get_world_size(group) > 1:
            torch.distributed.all_reduce(counts, group=group)
        for router, c in zip(self.routers, counts):
            bias = router.e_score_correction_bias
            bias += (self.rate * torch.sign(c.mean() - c)).to(bias.dtype)
        self._counts = None
        return counts


def expert_counts(picks: torch.Tensor, num_experts: int) -> torch.Tensor:
    """How many of ``picks`` name each expert, on their device ([E], int64; bincount's output
    size is read from the values: a host sync on a GPU)."""
    return torch.zeros(num_experts, dtype=torch.int64, device=picks.device).scatter_add_(
        0, picks, torch.ones_like(picks))


def router_recorder(model: torch.nn.Module):
    """The model's declared recorder of router logits (transformers' OutputRecorder), or None."""
    for module in (model, getattr(model, "model", None)):
        record = getattr(module, "_can_record_outputs", None) or {}
        if "router_logits" in record:
            return record["router_logits"]
    return None


def hf_router_loss(model: torch.nn.Module
                   ) -> HFRouterLoss | HFBiasBalance | HFRouterCounts | None:
    """For ``ParallelOptions.router_loss``: how meshtrain carries a transformers MoE model's
    load-balancing loss, or moves its routers' bias (``config.router_bias_rate``), or (neither
    on: ``output_router_logits`` off) only counts its routers' picks; None for a model without
    declared routers. Refuses a loss it cannot carry exactly, naming the config field."""
    from meshtrain.models.hf import is_hf_model

    config = getattr(model, "config", None)
    if not is_hf_model(model):
        return None
    rate = float(getattr(config, "router_bias_rate", 0) or 0)
    if rate:
        return _bias_balance(model, config, rate)
    if not getattr(config, "output_router_logits", False):
        return _counts_only(model)
    cls = next((c for c in type(model).__mro__ if c.__module__.startswith("transformers.")),
               type(model))  # (FSDP2 makes a subclass of the model's class)
    name = cls.__name__
    reference = getattr(sys.modules.get(cls.__module__), "load_balancing_loss_func", None)
    recorder = router_recorder(model)
    missing = [what for what, ok in (
        ("load_balancing_loss_func", reference is not None),
        ("a declared router-logits recorder", recorder is not None),
        ("router_aux_loss_coef", hasattr(config, "router_aux_loss_coef")),
        ("num_experts / num_experts_per_tok", hasattr(model, "num_experts")
         and hasattr(model, "num_experts_per_tok"))) if not ok]
    if missing:
        raise ConfigError(_refusal(name, f"it has no {', '.join(missing)}"))
    if not same_as_transformers(reference, int(model.num_experts), int(model.num_experts_per_tok)):
        raise ConfigError(_refusal(name, "its load_balancing_loss_func computes something else "
                                   "than meshtrain's copy (transformers changed it)"))
    return HFRouterLoss(model)


def _counts_only(model) -> HFRouterCounts | None:
    """The routers' picks counted (no loss), for a model that declares its routers."""
    recorder = router_recorder(model)
    if recorder is None or not (hasattr(model, "num_experts")
                                and hasattr(model, "num_experts_per_tok")):
        return None
    routers = [m for m in model.modules() if isinstance(m, recorder.target_class)]
    if not routers:
        return None
    return HFRouterCounts(RouterPicks(routers, int(model.num_experts),
                                      int(model.num_experts_per_tok), recorder.index or 0))


def _bias_balance(model, config, rate: float) -> HFBiasBalance:
    """``config.router_bias_rate``: the routers' ``e_score_correction_bias`` moved by meshtrain
    (refused for a model without one, or with a router loss on as well)."""
    name = type(model).__name__
    if rate < 0:
        raise ConfigError(f"config.router_bias_rate must be >= 0 (0 = off), got {rate!r}")
    routers = [m for m in model.modules()
               if isinstance(getattr(m, "e_score_correction_bias", None), torch.Tensor)]
    if not routers:
        raise ConfigError(f"{name} has config.router_bias_rate={rate:g}, which moves the "
                          "routers' e_score_correction_bias (DeepSeek-V3's auxiliary-loss-free "
                          "balancing), but its routers have none; unset router_bias_rate")
    if getattr(config, "output_router_logits", False):
        raise ConfigError(f"{name} has both config.router_bias_rate and output_router_logits: "
                          "meshtrain carries one of the two balancing methods for a Hugging "
                          "Face model; turn one off")
    return HFBiasBalance(model, routers, rate)


def same_as_transformers(reference, num_experts: int, top_k: int) -> bool:
    """Does meshtrain's balancing loss give transformers' ``reference`` bit for bit on random
    router logits of two layers, with and without an attention mask?"""
    gen = torch.Generator().manual_seed(0)
    logits = tuple(torch.randn(12, num_experts, generator=gen, dtype=torch.float64)
                   for _ in range(2))
    mask = (torch.rand(3, 4, generator=gen) > 0.3).long()
    for attention_mask in (None, mask):
        ours = balance_term(router_stats(logits, num_experts, top_k, attention_mask))
        theirs = reference(logits, num_experts, top_k, attention_mask)
        if not torch.equal(ours.double(), torch.as_tensor(theirs).double()):
            return False
    return True


def _refusal(name: str, why: str) -> str:
    return (f"{name} has config.output_router_logits=True: its loss adds router_aux_loss_coef x "
            f"the router's load-balancing loss, which meshtrain carries for transformers' MoE "
            f"models, but not for this one: {why}. Set output_router_logits=False (the router "
            "then trains without the balancing loss), or pass loss_fn= computing your own loss "
            "from the logits")


# --- expert parallel: the experts the model's ep plan declares, split by meshtrain -------------
class HFExperts:
    """A transformers MoE layer's fused experts (``gate_up_proj`` [E, 2I, H], ``down_proj``
    [E, H, I], any biases [E, ...], ``forward(hidden_states, top_k_index, top_k_weights)``) as
    ep splits them (meshtrain/parallel/expert/): this rank keeps rows ``rank*L ..``, its forward sorts the
    (token, slot) pairs by expert, sends them through ``dispatch`` and sums each token's
    outputs with its router weights; the local experts run the model's own forward (its own
    activation and matmuls) on tokens grouped by local expert, each with weight 1."""

    WEIGHTS = ("gate_up_proj", "down_proj")

    def __init__(self, module: torch.nn.Module):
        self.expert_module, self.num_experts = module, int(module.num_experts)
        self.dispatch = None
        self._own_forward = module.forward

    def split_experts(self, rank: int, size: int) -> list[torch.nn.Parameter]:
        local = self.num_experts // size
        rows = slice(rank * local, (rank + 1) * local)
        kept = []  # every tensor of the experts by rows: the weights and any biases (GPT-OSS:
        for name, whole in list(self.expert_module.named_parameters(recurse=False)):  # [E, ..])
            part = torch.nn.Parameter(whole.detach()[rows].clone(),
                                      requires_grad=whole.requires_grad)
            setattr(self.expert_module, name, part)
            kept.append(part)
        self.expert_module.num_experts = local  # (its own forward loops over these)
        self.expert_module.rows = rows
        self.expert_module.forward = self._forward
        return kept

    def compute_local(self, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """This rank's experts on ``tokens`` grouped by local expert (``counts`` [L], a device
        tensor: the expert ids are built on the device, no host sync), each with weight 1,
        through the model's own experts forward (:meth:`local_forward`)."""
        ids = torch.repeat_interleave(torch.arange(counts.numel(), device=tokens.device),
                                      counts.to(tokens.device), output_size=tokens.shape[0])
        ones = torch.ones(len(ids), 1, dtype=tokens.dtype, device=tokens.device)
        return self.local_forward(tokens.dtype)(tokens, ids[:, None], ones)

    def local_forward(self, dtype: torch.dtype):
        """The experts forward the model's config picks (transformers' ``experts_implementation``:
        "grouped_mm" by default, one grouped GEMM per weight), except where torch's grouped
        GEMM has no kernel for ``dtype`` (float64): there the model's eager loop, said once."""
        module = self.expert_module
        config = getattr(module, "config", None)
        eager = getattr(type(module).forward, "__wrapped__", None)  # (use_experts_implementation)
        asked = getattr(config, "_experts_implementation", None)
        if eager is None or asked in (None, "eager") or dtype in grouped.KERNEL_DTYPES:
            return self._own_forward
        grouped.say_once(f"{type(module).__name__}: {dtype} has no grouped GEMM kernel "
                         f"(experts_implementation={asked!r}); under ep its eager experts run")
        return eager.__get__(module)

    def _forward(self, hidden_states, top_k_index, top_k_weights):
        top_k = top_k_index.shape[-1]
        picks = top_k_index.reshape(-1)
        order = picks.argsort(stable=True)
        counts = expert_counts(picks, self.num_experts)
        done = self.dispatch(hidden_states[order // top_k], counts)
        out = torch.empty_like(done).index_copy(0, order, done)
        weights = top_k_weights.unsqueeze(-1).to(out.dtype)
        return (out.view(-1, top_k, out.shape[-1]) * weights).sum(1).to(hidden_states.dtype)


def hf_expert_layers(model: torch.nn.Module) -> list[HFExperts]:
    """For ``ParallelOptions.expert_layers``: the experts a transformers model's
    ``base_model_ep_plan`` marks ``ep_dispatch_experts``, whose weights it marks
    ``grouped_gemm`` (the fused 3-D ``gate_up_proj`` / ``down_proj``); [] for other models."""
    import fnmatch

    from meshtrain.models.hf import is_hf_model

    plan = getattr(getattr(model, "config", None), "base_model_ep_plan", None) or {}
    if not (is_hf_model(model) and plan):
        return []
    base = getattr(model, "base_model_prefix", "model")
    layers = []
    for name, module in model.named_modules():
        relative = name[len(base) + 1:] if name.startswith(base + ".") else name
        if not any(style == "ep_dispatch_experts" and fnmatch.fnmatchcase(relative, pattern)
                   for pattern, style in plan.items()):
            continue
        grouped = all(plan.get(f"{pattern}.{w}") == "grouped_gemm"
                      for pattern, style in plan.items() if style == "ep_dispatch_experts"
                      and fnmatch.fnmatchcase(relative, pattern) for w in HFExperts.WEIGHTS)
        if grouped and all(getattr(module, w, None) is not None and getattr(module, w).dim() == 3
                           for w in HFExperts.WEIGHTS) and hasattr(module, "num_experts") \
                and all(p.shape[:1] == (module.num_experts,)  # (each tensor one row an expert)
                        for p in module.parameters(recurse=False)):
            layers.append(HFExperts(module))
    return layers
