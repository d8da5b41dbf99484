"""ZeRO stage 1: optimizer state sharded, parameters and gradients replicated.

ZeRO (Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models", SC 2020), stage 1, through PyTorch's ``ZeroRedundancyOptimizer``: DDP all-reduces the
gradients as usual, each rank steps its own optimizer on the parameters it owns (about
``1 / world_size`` of them, whole tensors, greedily balanced by size), then broadcasts them.

Checkpoints keep the format of ``torch.distributed.checkpoint.state_dict.get_state_dict``
(``{"state": {fqn: {...}}, "param_groups": [{..., "params": [fqn, ...]}]}``), but each rank holds
only the ``state`` entries of the parameters it owns, so ``dcp.save`` writes every entry exactly
once and a checkpoint loads under any world size, owner assignment or plain optimizer::

    dcp.save({"model": msd, "optim": zero1_state_dict(model, opt)}, checkpoint_id=path)
    state = {"model": msd, "optim": zero1_state_dict_template(model, opt)}
    dcp.load(state, checkpoint_id=path)
    load_zero1_state_dict(model, opt, state["optim"])
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

from meshtrain.errors import ConfigError

# Wrapper modules whose attribute name get_state_dict leaves out of parameter FQNs.
_WRAPPER_NAMES = frozenset({"_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module"})


def make_zero1_optimizer(
    params: Iterable[torch.Tensor],
    optimizer_factory: Callable[[list[torch.Tensor]], torch.optim.Optimizer],
    group=None,
) -> ZeroRedundancyOptimizer:
    """Wrap the optimizer that ``optimizer_factory`` builds in a ``ZeroRedundancyOptimizer``.

    ``group`` is the data-parallel process group (default: the world). The factory is called
    once on the parameters to learn its class, options and parameter groups (no state exists
    before a step, so this allocates nothing); every group keeps its own options (e.g. no
    weight decay on norms and biases), and every parameter must be in one.
    """
    params = list(params)
    if not params:
        raise ConfigError("make_zero1_optimizer got no parameters; pass model.parameters()")
    if any(isinstance(p, dict) for p in params):
        raise ConfigError(
            "make_zero1_optimizer takes the model's parameters and builds the groups with the "
            "factory: group them inside it, e.g. lambda params: AdamW([{'params': ...}, ...])")
    optimizer_class, options, groups = optimizer_spec(optimizer_factory, params)
    return ZeroRedundancyOptimizer(
        groups,
        optimizer_class=optimizer_class,
        process_group=group,
        # Both settings match one process under DDP(gradient_as_bucket_view=True); False keeps
        # each parameter's own storage instead of re-pointing param.data into a flat buffer.
        parameters_as_bucket_view=False,
        # Overlapping the step with DDP's all-reduce needs a DDP hook and is refused on gloo.
        overlap_with_ddp=False,
        **options,
    )


def optimizer_spec(optimizer_factory, params: list | None = None
                   ) -> tuple[type[torch.optim.Optimizer], dict, list[dict]]:
    """The class, constructor options and parameter groups (each with all its options) of what
    ``optimizer_factory`` builds on ``params`` (ConfigError if they cannot be recovered)."""
    params = params if params is not None else [torch.nn.Parameter(torch.zeros(2, 2)),
                                                torch.nn.Parameter(torch.zeros(2))]
    try:
        probe_opt = optimizer_factory(list(params))
    except Exception as error:
        raise ConfigError(
            f"the optimizer factory failed on a list of parameters ({type(error).__name__}: "
            f"{error}); zero1 needs a function params -> Optimizer, e.g. "
            "lambda params: torch.optim.AdamW(params, lr=1e-3)"
        ) from error
    if not isinstance(probe_opt, torch.optim.Optimizer) or isinstance(
        probe_opt, ZeroRedundancyOptimizer
    ):
        raise ConfigError(
            f"the optimizer factory returned {type(probe_opt).__name__}; zero1 needs a plain "
            "torch.optim.Optimizer (meshtrain wraps it in ZeroRedundancyOptimizer itself)"
        )
    name = type(probe_opt).__name__
    kept = [p for g in probe_opt.param_groups for p in g["params"]]
    if len(kept) != len(params) or {id(p) for p in kept} != {id(p) for p in params}:
        raise ConfigError(
            f"the optimizer factory kept {len(kept)} of the {len(params)} parameters it was "
            f"given ({name}); under zero1 every parameter it receives must be in one group"
        )
    options = constructor_options(type(probe_opt), probe_opt.defaults)
    try:
        type(probe_opt)([torch.nn.Parameter(torch.zeros(2))], **options)
    except Exception as error:
        raise ConfigError(f"zero1 cannot rebuild {name}: {error}; pass the options as "
                          f"constructor arguments: lambda params: {name}(params, lr=...)"
                          ) from error
    groups = [{**_options(g), "params": list(g["params"])} for g in probe_opt.param_groups]
    return type(probe_opt), options, groups


def constructor_options(optimizer_class, defaults: dict) -> dict:
    """The entries of ``defaults`` the constructor accepts (AdamW records
    ``decoupled_weight_decay`` in its defaults but does not take it as an argument)."""
    signature = inspect.signature(optimizer_class.__init__).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.values())
    return {k: v for k, v in defaults.items() if takes_any or k in signature}


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    return type(a) is type(b) and a == b


# ---------------------------------------------------------------------------------------------
# Checkpoints
# ---------------------------------------------------------------------------------------------
def parameter_fqns(model: torch.nn.Module) -> dict[torch.Tensor, str]:
    """Parameter -> FQN as ``get_state_dict`` names it (no DDP, compile or wrapper prefixes)."""
    if isinstance(model, DistributedDataParallel):
        model = model.module
    return {
        param: ".".join(part for part in name.split(".") if part not in _WRAPPER_NAMES)
        for name, param in model.named_parameters()
    }


def _owned(model, optimizer) -> list[tuple[str, torch.Tensor, int]]:
    """(fqn, parameter, local group index) of each parameter this rank's optimizer steps."""
    if not isinstance(optimizer, ZeroRedundancyOptimizer):
        raise ConfigError(
            f"expected the ZeroRedundancyOptimizer from make_zero1_optimizer, got "
            f"{type(optimizer).__name__}; for plain optimizers use get_state_dict/set_state_dict"
        )
    fqns = parameter_fqns(model)
    owned = []
    for index, group in enumerate(optimizer.optim.param_groups):
        for param in group["params"]:
            if param not in fqns:
                raise ConfigError(
                    f"the optimizer holds a parameter of shape {tuple(param.shape)} that is not "
                    "in the model; pass the model whose parameters the optimizer was built on"
                )
            owned.append((fqns[param], param, index))
    return owned


def _param_groups(model, optimizer) -> list[dict]:
    fqns = parameter_fqns(model)
    return [
        {**_options(group), "params": [fqns[p] for p in group["params"]]}
        for group in optimizer.param_groups
    ]


def zero1_state_dict(model: torch.nn.Module, optimizer: ZeroRedundancyOptimizer) -> dict:
    """This rank's part of the optimizer state, in ``get_state_dict``'s format.

    ``state`` holds the parameters this rank owns (disjoint across ranks); ``param_groups`` is
    the same on every rank and lists every parameter's FQN. Tensors are the live ones (no copy).
    A parameter whose state does not exist yet (Adam before its first step) gets the state its
    optimizer creates in a zero-gradient, zero-lr step, as ``get_state_dict`` saves it; that
    state is computed on copies, so the live optimizer is left untouched.
    """
    owned = _owned(model, optimizer)
    live = optimizer.optim.state
    missing = [(fqn, p, g) for fqn, p, g in owned if not live.get(p)]
    initial = _initial_state(optimizer, missing) if missing else {}
    state = {fqn: dict(live[p]) if live.get(p) else initial[fqn] for fqn, p, _ in owned}
    return {"state": state, "param_groups": _param_groups(model, optimizer)}


def zero1_state_dict_template(model: torch.nn.Module, optimizer: ZeroRedundancyOptimizer) -> dict:
    """What this rank asks ``dcp.load`` for: the state keys, shapes and dtypes of the
    parameters it owns now (the saving run may have had another world size or owners)."""
    sd = zero1_state_dict(model, optimizer)
    sd["state"] = {
        fqn: {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in entry.items()}
        for fqn, entry in sd["state"].items()
    }
    return sd


def load_zero1_state_dict(
    model: torch.nn.Module, optimizer: ZeroRedundancyOptimizer, state: dict
) -> None:
    """Load the entries of the parameters this rank owns, and every group's options, from
    ``state`` (loaded by DCP from a zero1 or a plain ``get_state_dict`` checkpoint)."""
    owned = _owned(model, optimizer)
    saved_state, saved_groups = state.get("state", {}), state.get("param_groups", [])
    absent = [fqn for fqn, _, _ in owned if fqn not in saved_state]
    if absent:
        raise ConfigError(
            f"the checkpoint has no optimizer state for {', '.join(absent[:3])}"
            f"{' ...' if len(absent) > 3 else ''}; it was saved for another model or optimizer"
        )
    # Match each live group to the saved group that holds its parameters' FQNs.
    options = []
    for group in _param_groups(model, optimizer):
        match = [g for g in saved_groups if set(g["params"]) == set(group["params"])]
        if not match:
            raise ConfigError(
                "the checkpoint's optimizer parameter groups do not match this optimizer's "
                f"({len(saved_groups)} saved, {len(optimizer.param_groups)} here, parameters "
                "differ); load it into the same model and optimizer set-up"
            )
        options.append(_options(match[0]))
    # The exposed groups are copied into the local optimizer at every step: update both.
    for group, opts in zip(optimizer.param_groups, options):
        group.update(opts)
    # The local optimizer's state dict numbers its parameters group by group, in order.
    local_state = {i: saved_state[fqn] for i, (fqn, _, _) in enumerate(owned)}
    local_groups = [
        {**opts, "params": [i for i, (_, _, g) in enumerate(owned) if g == index]}
        for index, opts in enumerate(options)
    ]
    optimizer.optim.load_state_dict({"state": local_state, "param_groups": local_groups})


def _initial_state(optimizer: ZeroRedundancyOptimizer, params) -> dict[str, dict]:
    """FQN -> the state ``type(optimizer.optim)`` creates for each parameter in one zero-lr step
    with zero gradients (the same initialisation ``get_state_dict`` uses), on copies."""
    local, copies, groups = optimizer.optim, {}, []
    for g, group in enumerate(local.param_groups):
        for fqn, param, owner_group in params:
            if owner_group == g:
                copies[fqn] = param.detach().clone().requires_grad_(True)
                copies[fqn].grad = torch.zeros_like(param)
        members = [copies[fqn] for fqn, _, owner_group in params if owner_group == g]
        lr = group.get("lr", 0.0)
        zero_lr = torch.zeros_like(lr) if isinstance(lr, torch.Tensor) else 0.0
        if members:
            groups.append({**_options(group), "params": members, "lr": zero_lr})
    probe = type(local)(groups, **constructor_options(type(local), local.defaults))
    probe.step()
    return {fqn: dict(probe.state[copy]) for fqn, copy in copies.items()}


def _options(group: dict) -> dict:
    return {k: v for k, v in group.items() if k != "params"}
