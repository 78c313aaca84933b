"""The one place megatron-core is first imported from, with its import-time costs deferred.

megatron-core decorates its fusion functions with `torch.compile` at import, which imports
torch._dynamo and TorchInductor in every process although a CPU run calls none of them. Here
megatron-core is imported while `torch.compile` is `lazy_compile` (compiles on the first call),
then `torch.compile` is restored. Its `try: import wandb` gets the real module unexecuted
(`import_deferred`): `HAVE_WANDB` stays True and wandb's `__init__` runs on first use
(`importlib.util.LazyLoader` cannot: `inspect.getmodule` reads every module's `__file__`).

Every module of this project that imports megatron-core imports this module first
(`tests/test_import_layers.py` checks it; `benchmarks/bench_startup.py` measures the saving).
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import sys
import threading
import types
from typing import Any, Callable

import torch

_torch_compile = torch.compile
_DEFERRED_PACKAGE = "megatron."


def lazy_compile(model: Callable | None = None, **options: Any) -> Callable:
    """`torch.compile` that calls the real `torch.compile(model, **options)` on the first call of
    the decorated function instead of when decorating. Like `torch.compile`, it decorates with or
    without keyword options (`@lazy_compile`, `@lazy_compile(dynamic=True)`); anything that is not
    a plain function of megatron-core (an `nn.Module`, a Transformer Engine or apex function
    decorated while `megatron.core` imports them) is compiled at once, as by `torch.compile`."""
    if model is None:
        return functools.partial(lazy_compile, **options)
    if not inspect.isfunction(model) or not model.__module__.startswith(_DEFERRED_PACKAGE):
        return _torch_compile(model, **options)
    compiled: Callable | None = None
    lock = threading.Lock()

    @functools.wraps(model)
    def deferred(*args: Any, **kwargs: Any) -> Any:
        nonlocal compiled
        # Inside a region torch.compile is tracing, dynamo inlines a compiled function's original
        # code; do the same rather than trace the compile call.
        if torch.compiler.is_compiling():
            return model(*args, **kwargs)
        if compiled is None:
            with lock:
                if compiled is None:
                    compiled = _torch_compile(model, **options)
        return compiled(*args, **kwargs)

    return deferred


class _DeferredModule(types.ModuleType):
    """A module created from its spec but not executed yet: the attributes the import system sets
    (`__name__`, `__spec__`, `__file__`, `__loader__`, ...) read as they are; reading any other
    attribute, `__path__` included (so that importing a submodule runs the package first, as a
    plain import does), executes the module once and reads it from the executed module."""

    def __getattr__(self, attr: str) -> Any:
        with _deferred_lock:
            if type(self) is _DeferredModule:
                spec = self.__spec__
                self.__class__ = types.ModuleType
                if spec.submodule_search_locations is not None:
                    self.__path__ = spec.submodule_search_locations
                try:
                    spec.loader.exec_module(self)
                except BaseException:
                    sys.modules.pop(spec.name, None)
                    raise
        return getattr(self, attr)


_deferred_lock = threading.RLock()


def import_deferred(name: str) -> None:
    """Put the top-level module `name` into `sys.modules` unexecuted (`_DeferredModule`), where it
    is installed and not imported yet; else do nothing."""
    if name in sys.modules:
        return
    spec = importlib.util.find_spec(name)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    module.__dict__.pop("__path__", None)
    module.__class__ = _DeferredModule
    sys.modules[name] = module


import_deferred("wandb")
torch.compile = lazy_compile
try:
    import megatron.core  # noqa: E402, F401
finally:
    torch.compile = _torch_compile
