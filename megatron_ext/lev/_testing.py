"""Test support: run a function defined in a test file inside spawned ranks.

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
from typing import Any

__all__ = ["call_in_file"]


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
