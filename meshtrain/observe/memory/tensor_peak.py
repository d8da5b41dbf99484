"""The peak bytes of live tensors in a stretch of code, on any device (CPU included): what a
memory estimate that counts tensors is checked against where the allocator keeps no statistics.

    with TensorPeak() as peak:
        trainer.fit(...)
    peak.bytes        # the most bytes held at once by storages created inside

Every tensor an operator returns inside (the dispatcher's view, so C++ code that allocates on
this thread counts too: autograd, DDP's buckets, FSDP's all-gather buffers, the optimizer; a
DTensor's operators are counted as the local ones it runs) is counted once per storage until
the storage is freed; a storage resized (FSDP frees and
re-allocates its gathered parameters with ``resize_``) counts its new size. Not counted:
storages made before the block, and what other threads allocate (gloo's own buffers). It slows
every operator (a Python call each): measure memory and time in separate runs.
"""

from __future__ import annotations

import weakref

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class TensorPeak(TorchDispatchMode):
    """Context manager: ``bytes`` is the peak of live tensor bytes created inside; ``now`` the
    bytes still live."""

    def __init__(self):
        super().__init__()
        self.now = self.bytes = 0
        self._sizes: dict[int, int] = {}  # id of a tracked storage -> bytes counted
        self._refs: dict[int, weakref.ref] = {}
        self._resize = None

    def _track(self, storage: torch.UntypedStorage) -> None:
        key = id(storage)
        size = storage.nbytes()
        if key in self._refs and self._refs[key]() is storage:
            self._add(size - self._sizes[key])
            self._sizes[key] = size
            return
        self._sizes[key] = size
        self._refs[key] = weakref.ref(storage, lambda _, key=key: self._free(key))
        self._add(size)

    def _free(self, key: int) -> None:
        self.now -= self._sizes.pop(key, 0)
        self._refs.pop(key, None)

    def _add(self, size: int) -> None:
        self.now += size
        self.bytes = max(self.bytes, self.now)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if DTensor in types:
            return NotImplemented  # its local operators come back here
        out = func(*args, **(kwargs or {}))
        for value in tree_flatten(out)[0]:
            # plain tensors only: not meta, fake (DTensor's sharding propagation) or sparse
            if type(value) in (torch.Tensor, torch.nn.Parameter) and not (
                    value.device.type == "meta" or value.is_sparse):
                self._track(value.untyped_storage())
        return out

    def __enter__(self):
        resize, peak = torch.UntypedStorage.resize_, self

        def resize_(storage, size):
            result = resize(storage, size)
            key = id(storage)
            if key in peak._refs and peak._refs[key]() is storage:
                peak._track(storage)
            return result

        self._resize = resize
        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._resize
        return super().__exit__(*exc)
