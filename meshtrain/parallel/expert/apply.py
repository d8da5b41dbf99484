"""``apply_expert_parallel``: each MoE layer keeps its share of the experts and dispatches
tokens by all-to-all (dispatch.py); what the rest of the step does differently under ``ep``.

* **The split.** A layer that can be split has ``split_experts(rank, size)`` (meshtrain's MoE,
  meshtrain/moe/layer.py): it keeps rows ``rank*L .. (rank+1)*L`` of its grouped expert
  weights ``[E, ...]`` as plain parameters. DDP leaves them out; under zero2/zero3 FSDP2
  shards each holder over its ``edp`` ranks (:func:`shard_experts`: inside this rank's rows,
  a mesh of its own). Everything else of the model is data parallel over the same ranks as
  before.
* **Gradients.** An expert's gradient on its rank already sums what every rank of its ep group
  sent it (the all-to-all's backward); summed over the ``edp`` ranks that hold the same experts
  and divided by the data-parallel degree (each rank's loss is scaled for an average over
  them) it is one process's gradient (by hand, or FSDP2's reduce-scatter with that divisor).
* **The gradient norm** adds the experts' squares over the ep group to the rest's.
* **State.** ``state_dict()`` gives the experts as DTensors of the whole tensors, sharded
  over ``ep`` by rows (and over ``edp`` inside them where FSDP2 shards: ``(Shard(0),
  Shard(0))`` on ``ParallelMesh.expert_rows``), so gathering the whole model (``whole_state``)
  and DCP checkpoints see whole tensors; ``load_state_dict`` takes them back as held (DCP
  reads each rank's part into them).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from meshtrain.errors import ConfigError
from meshtrain.parallel.expert.dispatch import AllToAllExperts
from meshtrain.parallel.layout_hints import ep_advice


def expert_layers(model: torch.nn.Module, adapt=None) -> list:
    """The model's MoE layers whose experts ep can split: its modules with ``split_experts``
    (meshtrain's MoE), else what ``adapt(model)`` gives (a Hugging Face model's, from its
    declared ep plan). Each has ``num_experts``, ``split_experts(rank, size)`` (keeps those
    rows, returns the new parameters), ``expert_module`` (the module holding them),
    ``compute_local(tokens, counts)`` (this rank's experts on tokens grouped by expert) and a
    ``dispatch`` to set (what its forward sends the routed tokens through)."""
    own = [m for m in model.modules() if callable(getattr(m, "split_experts", None))]
    return own or (list(adapt(model)) if adapt is not None else [])


def check_expert_parallel(model: torch.nn.Module, ep: int, adapt=None,
                          ranks: int | None = None) -> None:
    """Before start: ``ep`` needs layers that can split their experts, E of each a multiple
    of ``ep``; a refusal offers the degrees that fit E and the ``ranks`` ep borrows (the
    layout's data- and context-parallel ranks)."""
    layers = expert_layers(model, adapt)
    if not layers:
        raise ConfigError(
            f"ep={ep} splits the experts of mixture-of-experts layers, and "
            f"{type(model).__name__} has none meshtrain can split (meshtrain's MoE layers, or "
            "a Hugging Face model whose config declares base_model_ep_plan with its experts "
            "as 'ep_dispatch_experts'); drop ep (a dense model is data parallel over the same "
            "ranks with dp)")
    for layer in layers:
        if layer.num_experts % ep:
            raise ConfigError(
                f"ep={ep} does not divide the {layer.num_experts} experts of "
                f"{type(layer.expert_module).__name__}: each rank must hold the same number; "
                + ep_advice(layer.num_experts, ranks or ep))


def apply_expert_parallel(model: torch.nn.Module, mesh, adapt=None) -> list[torch.nn.Parameter]:
    """Split every MoE layer's experts over ``mesh.expert["ep"]``; returns the expert
    parameters (the ones data parallelism must leave alone)."""
    ep_mesh = mesh.expert["ep"]
    rank, size = ep_mesh.get_local_rank(), ep_mesh.size()
    params = []
    for layer in expert_layers(model, adapt):
        kept = layer.split_experts(rank, size)  # (rows ``holder.rows`` of ``whole_rows``)
        layer.expert_module.whole_rows = layer.num_experts
        layer.dispatch = AllToAllExperts(layer.compute_local, mesh.expert_dispatch, size)
        holder = layer.expert_module
        holder.ep_mesh = ep_mesh  # (plain tensors holding rows of whole ones)
        holder.edp_mesh = mesh.expert["edp"]  # (FSDP2 shards them over it: apply_fsdp)
        holder.rows_mesh = None if mesh.expert_rows is None else mesh.expert_rows["ep", "edp"]
        _state_as_dtensors(holder, ep_mesh, [n for n, p in holder.named_parameters()
                                             if any(p is k for k in kept)])
        params += kept
    return params


def expert_params(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters ep split (of modules marked with their ``ep_mesh``)."""
    return [p for m in model.modules() if getattr(m, "ep_mesh", None) is not None
            for p in m.parameters(recurse=False)]


def shard_experts(model: torch.nn.Module, **fsdp_options) -> None:
    """Under a sharded layout (zero2/zero3): FSDP2 shards each expert holder over its ``edp``
    ranks (inside this rank's rows), its gradients summed over them and divided by the data-
    parallel degree (edp x ep) as the module docstring says. An edp of one rank too: the
    experts are then DTensors like the dense part (a foreach optimizer, torch's default on
    CUDA, refuses a list mixing them with plain tensors)."""
    from torch.distributed.fsdp import fully_shard

    from meshtrain.parallel.data.fsdp_comm import use_gloo_collectives

    sharded = []
    for module in model.modules():
        if getattr(module, "ep_mesh", None) is None:
            continue
        assert module.rows_mesh is not None, "a sharded layout's ParallelMesh has expert_rows"
        fully_shard(module, mesh=module.edp_mesh, **fsdp_options)
        if module.edp_mesh.size() == 1:  # torch 2.13 divides a one-rank mesh's gradients by
            module.set_gradient_divide_factor(1.0)  # the factor twice: sync_expert_grads does
        else:
            module.set_gradient_divide_factor(float(module.edp_mesh.size() *
                                                    module.ep_mesh.size()))
            module.set_force_sum_reduction_for_comms(True)  # (SUM, then divided: any backend)
        sharded.append(module)
    if sharded:
        use_gloo_collectives(sharded, sharded[0].edp_mesh.get_group())


_BUCKET = 25 * 2**20  # bytes: DDP's default bucket_cap_mb


def sync_expert_grads(model: torch.nn.Module, mesh) -> None:
    """The experts' gradients summed over the ranks holding the same experts, divided by the
    data-parallel degree (see the module docstring); FSDP2 already did it for experts it
    shards over several ranks (over one: only divided here)."""
    from torch.distributed.tensor import DTensor

    for p in expert_params(model):  # experts that got no token on any rank of the step: a
        if p.grad is None and p.requires_grad:  # zero gradient, as one process's [E, ...]
            p.grad = torch.zeros_like(p)  # tensor has (its other experts had tokens)
    params = [p for p in expert_params(model) if p.grad is not None
              and (not isinstance(p.grad, DTensor) or p.grad.device_mesh.size() == 1)]
    if not params:
        return
    edp = mesh.expert["edp"]
    if edp.size() > 1:  # in buckets closed at DDP's 25 MiB, so that the flat copy never costs
        bucket, size = [], 0  # all of a large model's expert gradients once more
        for p in params:
            bucket.append(p)
            size += p.grad.numel() * p.grad.element_size()
            if size >= _BUCKET or p is params[-1]:
                flat = torch.cat([q.grad.reshape(-1) for q in bucket])
                dist.all_reduce(flat, group=edp.get_group())
                for q, part in zip(bucket, flat.split([q.numel() for q in bucket])):
                    q.grad.copy_(part.view_as(q.grad))
                bucket, size = [], 0
    degree = mesh.layout.loss_degree
    for p in params:
        p.grad.div_(degree)


def clip_grad_norm(model: torch.nn.Module, params, max_norm: float | None, mesh
                   ) -> torch.Tensor:
    """The global gradient norm of ``params`` (``model``'s experts' squares summed over the ep
    group; under pp everything summed over the stages), clipping them to ``max_norm`` unless
    None."""
    from torch.distributed.tensor import DTensor

    held = {id(p) for p in expert_params(model)}
    params = [p for p in params if p.grad is not None]
    experts = [p for p in params if id(p) in held]
    rest = [p for p in params if id(p) not in held]
    dense = torch.nn.utils.get_total_norm([p.grad for p in rest])
    if isinstance(dense, DTensor):
        dense = dense.full_tensor()
    squares = torch.nn.utils.get_total_norm([p.grad for p in experts])
    if isinstance(squares, DTensor):  # FSDP-sharded over edp: summed over it first
        squares = squares.full_tensor()
    squares = squares ** 2
    dist.all_reduce(squares, group=mesh.expert["ep"].get_group())
    squares = dense.to(squares.dtype) ** 2 + squares
    if mesh.layout.degree("pp") > 1:
        dist.all_reduce(squares, group=mesh.mesh.get_group("pp"))
    norm = squares.sqrt()
    if max_norm is not None:  # (each kind apart: a foreach op refuses plain tensors and
        for kind in (experts, rest):  # DTensors, or DTensors of two meshes, in one list)
            by_mesh: dict = {}
            for p in kind:
                by_mesh.setdefault(getattr(p.grad, "device_mesh", None), []).append(p)
            for group in by_mesh.values():
                torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm)
    return norm


def _as_whole(value: torch.Tensor, module: torch.nn.Module):
    """A held expert tensor (this rank's rows; FSDP2's shard of them over edp as a DTensor) as
    a DTensor of the whole ``[E, ...]`` tensor: sharded by rows over ep (and over edp inside)."""
    from torch.distributed.tensor import DTensor, Shard

    if isinstance(value, DTensor):
        local, mesh, placements = value.to_local(), module.rows_mesh, [Shard(0), Shard(0)]
    else:
        local, mesh, placements = value, module.ep_mesh, [Shard(0)]
    shape = torch.Size((value.shape[0] * module.ep_mesh.size(), *value.shape[1:]))
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape,
                              stride=torch.empty(shape, device="meta").stride())


def _as_held(value, module: torch.nn.Module):
    """The inverse of :func:`_as_whole` (DCP read this rank's part into our own template)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor, Shard

    local = value.to_local()
    if not isinstance(module, FSDPModule):
        return local
    shape = torch.Size((value.shape[0] // module.ep_mesh.size(), *value.shape[1:]))
    return DTensor.from_local(local, module.edp_mesh, [Shard(0)], run_check=False, shape=shape,
                              stride=torch.empty(shape, device="meta").stride())


def _state_as_dtensors(module: torch.nn.Module, ep_mesh, names: list[str]) -> None:
    """``module``'s ``names`` in its state_dict as DTensors of the whole tensors sharded by rows
    over ``ep_mesh`` (and over edp where FSDP2 shards them); loaded back as held."""
    from torch.distributed.tensor import DTensor

    def save(module, state, prefix, local_metadata):
        for name in names:
            key = prefix + name
            value = state.get(key)
            if value is not None and (not isinstance(value, DTensor) or
                                      value.device_mesh == module.edp_mesh):
                state[key] = _as_whole(value, module)
        return state

    def load(module, state, prefix, *args):
        for name in names:
            value = state.get(prefix + name)
            if isinstance(value, DTensor) and value.device_mesh != module.edp_mesh:
                state[prefix + name] = _as_held(value, module)

    module._register_state_dict_hook(save)
    module._register_load_state_dict_pre_hook(load, with_module=True)


def _expert_modules(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """{parameter name: its module} of the experts ep split."""
    return {f"{name}.{p_name}" if name else p_name: module
            for name, module in model.named_modules()
            if getattr(module, "ep_mesh", None) is not None
            for p_name, _ in module.named_parameters(recurse=False)}


def optim_state_as_dtensors(model: torch.nn.Module, optim_sd: dict) -> None:
    """In place: the experts' optimizer state (keyed by parameter name) as DTensors of whole
    tensors, as their weights are in ``state_dict()`` (DCP saves them whole, and loads into
    them each rank's part)."""
    from torch.distributed.tensor import DTensor

    for name, module in _expert_modules(model).items():
        entry = optim_sd.get("state", {}).get(name)
        if entry:  # (a new dict: get_state_dict's entries are the optimizer's own, which a
            # training that goes on after the save must keep as they were)
            optim_sd["state"][name] = {
                key: _as_whole(value, module) if isinstance(value, torch.Tensor) and
                value.dim() > 0 and not (isinstance(value, DTensor) and
                                         value.device_mesh != module.edp_mesh) else value
                for key, value in entry.items()}


def optim_state_as_local(model: torch.nn.Module, optim_sd: dict) -> None:
    """In place: the inverse of :func:`optim_state_as_dtensors` (as the optimizer holds it)."""
    from torch.distributed.tensor import DTensor

    for name, module in _expert_modules(model).items():
        for key, value in (optim_sd.get("state", {}).get(name) or {}).items():
            if isinstance(value, DTensor) and value.device_mesh != module.edp_mesh:
                optim_sd["state"][name][key] = _as_held(value, module)
