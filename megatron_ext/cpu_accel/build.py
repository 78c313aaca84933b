"""Compile-on-first-use C++ CPU kernels, loaded with ctypes (shared by every such kernel).

A kernel's C++ source is compiled with the system C++ compiler ($CXX, else c++, g++ or clang++)
and -O3 -march=native -fopenmp into a shared library cached under $MEGATRON_EXT_CACHE (default
~/.cache/megatron_ext), keyed by the source, the flags, the compiler and the CPU; later
processes load it in milliseconds. A missing compiler or a failed build raises
`CpuKernelUnavailable` with a one-line reason that ends with the caller's `hint` (what to do
instead, e.g. "pass --lev-kernel torch").
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
from pathlib import Path
from typing import Callable, Optional

from megatron_ext._paths import atomic_path

logger = logging.getLogger(__name__)

__all__ = ["CpuKernelUnavailable", "build_library", "cache_dir", "load_error"]

FLAGS = ["-O3", "-march=native", "-fopenmp", "-std=c++17", "-shared", "-fPIC"]


class CpuKernelUnavailable(RuntimeError):
    """A C++ CPU kernel cannot be built or loaded here (the message says why)."""


def cache_dir() -> Path:
    """$MEGATRON_EXT_CACHE, else $XDG_CACHE_HOME/megatron_ext, else ~/.cache/megatron_ext."""
    root = os.environ.get("MEGATRON_EXT_CACHE")
    if root:
        return Path(root)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "megatron_ext"


def _compiler(what: str, hint: str) -> str:
    """$CXX when set (and only it), else the first of c++, g++, clang++ on the PATH."""
    chosen = os.environ.get("CXX")
    for name in [chosen] if chosen else ["c++", "g++", "clang++"]:
        if shutil.which(name):
            return shutil.which(name)
    where = f"$CXX={chosen}" if chosen else "c++, g++, clang++"
    raise CpuKernelUnavailable(
        f"no C++ compiler found ({where}) to build the {what}; install one (e.g. "
        f"apt-get install g++), set $CXX, or {hint}"
    )


def _cpu_signature() -> str:
    """What -march=native depends on: the CPU model and its feature flags."""
    try:
        with open("/proc/cpuinfo") as handle:
            lines = [ln for ln in handle if ln.startswith(("model name", "flags", "Features"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor() or platform.machine()


def _build(compiler: str, source: Path, target: Path, what: str, hint: str) -> None:
    """Compile to a temporary name in the cache, then rename (safe with concurrent ranks)."""
    with atomic_path(target) as tmp:
        proc = subprocess.run(
            [compiler, *FLAGS, str(source), "-o", tmp], capture_output=True, text=True
        )
        if proc.returncode != 0:
            lines = proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"]
            first = next((ln for ln in lines if "error" in ln), lines[-1]).strip()
            raise CpuKernelUnavailable(
                f"building the {what} with {compiler} failed: {first[-300:]}; fix the compiler "
                f"or {hint}"
            )


def build_library(source: Path, what: str, hint: str) -> ctypes.CDLL:
    """The shared library of the C++ file `source`, built on first use and cached on disk
    (callers cache the handle per process); `what` names the kernel in messages, `hint` says what
    to do instead. Raises CpuKernelUnavailable: no compiler, or the build failed."""
    compiler = _compiler(what, hint)
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256(
        "\n".join([source.read_text(), " ".join(FLAGS), version, _cpu_signature()]).encode()
    ).hexdigest()[:16]
    target = cache_dir() / f"{source.stem}_{key}.so"
    if not target.exists():
        logger.info("building the %s %s", what, target)
        _build(compiler, source, target, what, hint)
    return ctypes.CDLL(str(target))


def load_error(load: Callable[[], ctypes.CDLL]) -> Optional[str]:
    """None when `load()` (a kernel's `load_library`) succeeds, else the one-line reason it
    cannot be used here (no compiler, a failed build, a library that does not load)."""
    try:
        load()
    except (CpuKernelUnavailable, OSError) as err:
        return str(err)
    return None
