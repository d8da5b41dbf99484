"""The layout's named meshes: built once from a :class:`~meshtrain.parallel.layout.Layout`.

The layout knows the degrees; this object holds the ``DeviceMesh`` and the sub-meshes each part
of the step needs, so no other module flattens or slices the mesh itself:

========== =====================================================================================
``batch``  all data-parallel axes as one: which slice of the global batch a rank reads
``loss``   the batch axes and ``cp``: the loss is averaged, and replicated gradients are
           averaged by hand, over it
``shard``  what FSDP2 shards over: ``dp_shard`` (with ``cp`` folded in), 2-D with ``dp_replicate``
           for HSDP
``axis(n)`` one named axis (``pp``, ``tp``, ``cp``, ``dp``), or None when its degree is 1
``expert``  under ``ep``: 2-D (``edp``, ``ep``) over the data-parallel ranks: ``ep`` the ranks
           that split the experts (consecutive ranks), ``edp`` those holding the same experts;
           3-D (``pp``, ``edp``, ``ep``) under pp: each stage's ranks split its experts
========== =====================================================================================

:meth:`ParallelMesh.local_p2p` adds, for CPU processes of one host, a shared-memory group over
the same ranks as a (possibly flattened) axis (``shm/p2p.py``): pipeline sends, FSDP's shards.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from meshtrain.errors import ConfigError
from meshtrain.parallel.layout import Layout


class ParallelMesh:
    """The device mesh of ``layout`` and its named sub-meshes (needs a process group when the
    layout has more than one rank; with one rank every mesh is None)."""

    def __init__(self, layout: Layout, device_type: str, *, local_comm: str = "auto"):
        self.layout, self.local_comm = layout, local_comm
        self._local_p2p: dict[tuple[str, ...], object] = {}
        self._shm: dict[str, bool] = {}  # device type -> whether shared memory applies
        self.mesh = layout.build_mesh(device_type, self._axis_backends(device_type))
        self.batch = self._flat(layout.batch_axes, "batch")
        self.loss = self.batch if layout.loss_axes == layout.batch_axes else self._flat(
            layout.loss_axes, "loss")
        self.shard = None
        # the axes FSDP2 reduces over (its last mesh dim; cp folded in): for local_p2p
        self.shard_axes = ("dp_shard", "cp") if layout.degree("cp") > 1 else ("dp_shard",)
        if layout.is_sharded:
            shard_axes = ("dp_shard",)
            if layout.degree("cp") > 1:  # FSDP shards over dp_shard and cp together
                self.mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
                shard_axes = ("dp_shard_cp",)
            if layout.degree("dp_replicate") > 1:
                shard_axes = ("dp_replicate", *shard_axes)
            self.shard = self.mesh[shard_axes]
        self.expert = self.expert_dispatch = None
        if layout.expert_degree > 1:  # (ep borrows the data- and context-parallel ranks)
            from torch.distributed.device_mesh import init_device_mesh

            ep, pp = layout.expert_degree, layout.degree("pp")
            # pp is the mesh's outermost axis: a stage's ranks are consecutive, and so are ep's
            edp = layout.expert_data_degree
            shape, names = (edp, ep), ("edp", "ep")
            if pp > 1:
                shape, names = (pp, edp, ep), ("pp", "edp", "ep")
            self.expert = init_device_mesh(device_type, shape, mesh_dim_names=names)
            # the tokens' all-to-alls on a group of their own (a precaution): a mesh dim as wide
            # as the world reuses the default group, which DDP also reduces on, asynchronously,
            # in the same backward, where ranks' graphs differ with their routing
            for ranks in self.expert.mesh.reshape(-1, ep).tolist():  # (every rank makes each)
                group = dist.new_group(ranks)
                if dist.get_rank() in ranks:
                    self.expert_dispatch = group
        # the same ranks with ep before edp: a sharded layout's experts are FSDP-sharded over
        # edp inside each ep rank's rows, which DTensor writes (Shard(0), Shard(0)) on this
        # (over an edp of one rank too: DTensors like the rest, as foreach optimizers need)
        self.expert_rows = None
        if self.expert is not None and layout.is_sharded:
            from torch.distributed.device_mesh import DeviceMesh

            names = self.expert.mesh_dim_names
            order = [*range(len(names) - 2), len(names) - 1, len(names) - 2]
            self.expert_rows = DeviceMesh(device_type, self.expert.mesh.permute(order),
                                          mesh_dim_names=tuple(names[i] for i in order))

    def _axis_backends(self, device_type: str) -> dict[str, str]:
        """The tp axis's collectives through shared memory where it applies (CPU processes of
        one host, ``local_comm="auto"``: ``shm/collectives.py``)."""
        if self.layout.degree("tp") == 1 or not dist.is_initialized():
            return {}
        from meshtrain.parallel.shm import collectives as shm_collectives

        if not self._shm_applies(device_type):
            return {}
        return {"tp": shm_collectives.BACKEND}

    def _shm_applies(self, device_type: str) -> bool:
        """``shm.p2p.applies``, asked once (it probes the ranks' shared memory together)."""
        from meshtrain.parallel.shm import p2p as shm_p2p

        if device_type not in self._shm:
            self._shm[device_type] = shm_p2p.applies(device_type, self.local_comm)
        return self._shm[device_type]

    def loss_group(self):
        """The process group of the ranks whose losses are averaged (batch axes and cp), or
        None with one such rank: what logged values are reduced over."""
        return self.loss.get_group() if self.loss is not None else None

    def stage_group(self):
        """The pipeline's process group (None without pp): logged values cross it (a
        module's steps run on the last stage only)."""
        return self.mesh.get_group("pp") if self.layout.degree("pp") > 1 else None

    def everyone(self):
        """The process group of every rank of the mesh (None with one rank): the default
        group, unless parameter servers stand outside the mesh (a ps layout's mesh is 1-D)."""
        if self.mesh is None:
            return None
        if self.mesh.ndim == 1:
            return self.mesh.get_group()
        assert not self.layout.num_servers, "a ps layout's mesh is 1-D"
        return dist.group.WORLD

    def _flat(self, axes: tuple[str, ...], name: str):
        if not axes:
            return None
        return self.mesh[axes[0]] if len(axes) == 1 else self.mesh[axes]._flatten(name)

    def local_p2p(self, axes: tuple[str, ...], device: torch.device):
        """This rank's shared-memory group (``shm.p2p.LocalP2PGroup``) over the ranks that
        ``axes`` of the mesh span together (e.g. ``("dp_shard", "cp")``: FSDP's flattened
        axis), or None where it does not apply (``local_comm="backend"``, not CPU and gloo,
        ranks that cannot share memory). Every rank calls it the same way; made once per axes."""
        from meshtrain.parallel.shm.p2p import local_p2p_group

        if self.mesh is None:
            return None
        if axes not in self._local_p2p:
            names = list(self.mesh.mesh_dim_names)
            inner = [names.index(a) for a in axes]
            outer = [i for i in range(len(names)) if i not in inner]
            size = 1
            for i in inner:
                size *= self.mesh.mesh.shape[i]
            groups = self.mesh.mesh.permute(*outer, *inner).reshape(-1, size).tolist()
            self._local_p2p[axes] = local_p2p_group(groups, device, self.local_comm,
                                                    known=self._shm_applies(device.type))
        return self._local_p2p[axes]

    def axis(self, name: str):
        """The 1-D mesh of axis ``name``; None when the layout does not use it."""
        return self.mesh[name] if self.layout.degree(name) > 1 else None

    @property
    def batch_rank(self) -> int:
        """This rank's index among the ranks that see different samples."""
        return self.batch.get_local_rank() if self.batch is not None else 0

    @property
    def random_rank(self) -> int:
        """This rank's random stream (dropout, a dataset's draws in the main process): the
        first rank of its tensor- and context-parallel group, which compute the same samples
        together (tp's ranks hold the same activations outside the split parts: different
        masks would make them disagree); data-parallel ranks and pipeline stages draw apart."""
        if self.mesh is None:
            return 0
        names = self.mesh.mesh_dim_names or ()
        at = [0 if name in ("tp", "cp") else i
              for name, i in zip(names, self.mesh.get_coordinate())]
        return int(self.mesh.mesh[tuple(at)])

    def mean_loss(self, value: torch.Tensor) -> float:
        """``value`` averaged over the loss axes (after summing over pipeline stages, where
        only the last stage holds the loss and the others hold zero)."""
        value = value.detach().clone()
        if self.layout.degree("pp") > 1:
            dist.all_reduce(value, group=self.mesh.get_group("pp"))
        if self.loss is not None:
            dist.all_reduce(value, group=self.loss.get_group())
            value /= self.layout.loss_degree
        return float(value)

    def sum_over_loss_ranks(self, totals: torch.Tensor) -> torch.Tensor:
        """Sum ``totals`` (in place) over the pipeline stages and the loss axes."""
        if self.layout.degree("pp") > 1:
            dist.all_reduce(totals, group=self.mesh.get_group("pp"))
        if self.loss is not None:
            dist.all_reduce(totals, group=self.loss.get_group())
        return totals


def as_process_group(group):
    """``group`` as a ``ProcessGroup`` (or None): a 1-D ``DeviceMesh`` gives its group."""
    if group is None or isinstance(group, dist.ProcessGroup):
        return group
    if hasattr(group, "get_group") and getattr(group, "ndim", None) == 1:
        return group.get_group()
    raise ConfigError(
        f"expected a torch.distributed ProcessGroup, a 1-D DeviceMesh or None, got {group!r}"
    )
