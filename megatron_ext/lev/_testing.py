"""Test and benchmark support for LEV.

- `saved_tensor_bytes`: bytes autograd saves for backward while a closure runs (activations
  only: storages of the given parameters are excluded, shared storages counted once).
- `call_in_file`: run a function defined in a test file inside spawned ranks.

`run_distributed` pickles its function by module name, which a child process can only import if
the parent's import of that module is reproducible; under pytest's `--import-mode=importlib`
test files are not importable by name. `call_in_file(path, name, *args)` is an importable
trampoline that loads the file by location in the child and calls `name(*args)`::

    run_distributed(call_in_file, 2, tp=2, args=(__file__, "_check_tp", ...))
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

__all__ = ["call_in_file", "saved_tensor_bytes"]


def saved_tensor_bytes(
    closure: Callable[[], Any], exclude: Iterable[torch.Tensor] = ()
) -> tuple[int, Any]:
    """Run `closure()` and return (bytes of distinct storages saved for backward, its result).

    Storages of `exclude` (e.g. the module's parameters) are not counted: they exist anyway.
    Keep the result alive to keep the graph; the count covers what stays saved until backward.
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


def call_in_file(path: str, name: str, *args: Any) -> Any:
    """Import the Python file at `path` (once per process) and return `<name>(*args)`."""
    module_name = f"_lev_file_{Path(path).stem}"
    module = sys.modules.get(module_name)
    if module is None:
        spec = importlib.util.spec_from_file_location(module_name, path)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot load {path}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        spec.loader.exec_module(module)
    return getattr(module, name)(*args)
