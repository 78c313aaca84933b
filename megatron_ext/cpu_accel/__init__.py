"""CPU accelerations: compiled kernels and tuning that make CPU runs faster, in one room.

Nothing here changes what is computed: each piece has a portable path in the core, taken when
the piece is off or cannot be built. The core asks at its extension points (each accessor
returns the module, or None when off): `lev_backend()`, `cross_entropy_kernel()`,
`decode_step()`, `host_memory_tuning()`. `build` compiles the C++ sources on first use. One
switch turns all off: ``MEGATRON_EXT_CPU_ACCEL=0`` or ``--no-cpu-accel``.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import Optional

__all__ = [
    "ENV",
    "OFF",
    "cross_entropy_kernel",
    "decode_step",
    "disable",
    "enabled",
    "host_memory_tuning",
    "lev_backend",
]

ENV = "MEGATRON_EXT_CPU_ACCEL"
OFF = f"the CPU accelerations are off ({ENV}=0 or --no-cpu-accel)"
"""Why a piece is not used while the switch is off (for log lines and errors)."""


def enabled() -> bool:
    """Whether the accelerations may be used: unless ``MEGATRON_EXT_CPU_ACCEL`` is 0 (or off,
    false, no)."""
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "off", "false", "no")


def disable() -> None:
    """Turn the accelerations off for this process and every process it starts."""
    os.environ[ENV] = "0"


def _piece(name: str) -> Optional[ModuleType]:
    return importlib.import_module(f"{__name__}.{name}") if enabled() else None


def lev_backend() -> Optional[ModuleType]:
    """The C++ LEV backend's module (`CPU_BACKEND`, `cpu_kernel_error()`), None when off."""
    return _piece("lev_kernel")


def cross_entropy_kernel() -> Optional[ModuleType]:
    """The C++ cross entropy's module (`cross_entropy()`, `kernel_error()`), None when off."""
    return _piece("cross_entropy")


def decode_step() -> Optional[ModuleType]:
    """The lean decode step's module (`LeanDecoder`, `lean_decode_unsupported()`), None when
    off."""
    return _piece("lean_decode")


def host_memory_tuning() -> Optional[ModuleType]:
    """The host-memory tuning's module (`retain_freed_host_memory()`), None when off."""
    return _piece("host_memory")
