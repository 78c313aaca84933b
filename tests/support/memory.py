"""Activation-memory measurement for tests and benchmarks."""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch

__all__ = ["saved_tensor_bytes"]


def saved_tensor_bytes(
    closure: Callable[[], Any], exclude: Iterable[torch.Tensor] = ()
) -> tuple[int, Any]:
    """Run `closure()` and return (bytes of distinct storages saved for backward, its result).

    Storages of `exclude` (e.g. the module's parameters) are not counted: they exist anyway.
    Shared storages are counted once. Keep the result alive to keep the graph; the count covers
    what stays saved until backward.
    """
    excluded = {t.untyped_storage().data_ptr() for t in exclude}
    seen: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in excluded:
            seen[ptr] = max(seen.get(ptr, 0), storage.nbytes())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        result = closure()
    return sum(seen.values()), result
