"""The modeling code of a `--hf-format leviathan` export, made from this package's source.

An export carries configuration_leviathan.py, modeling_leviathan.py and lev_math.py (a copy of
`megatron_ext/lev/math.py`) plus `auto_map` in config.json, so that
`AutoModelForCausalLM.from_pretrained(export, trust_remote_code=True)` works where only torch,
transformers and safetensors are installed. The files are copied from the package at export
time with each `from megatron_ext.<module> import ...` rewritten to `from .<file> import ...`;
a package import left over (a module this list does not carry) is an error, not a file that
fails in the user's process.
"""

from __future__ import annotations

import os
import re

from megatron_ext._paths import atomic_write

__all__ = ["AUTO_MAP", "REMOTE_CODE_FILES", "remote_code_sources", "write_remote_code"]

_PACKAGE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

REMOTE_CODE_FILES = {
    "megatron_ext.conversion.hf_leviathan.configuration_leviathan": "configuration_leviathan",
    "megatron_ext.conversion.hf_leviathan.modeling_leviathan": "modeling_leviathan",
    "megatron_ext.lev.math": "lev_math",
}
"""Package module -> file name (without .py) in the export."""

AUTO_MAP = {
    "AutoConfig": "configuration_leviathan.LeviathanConfig",
    "AutoModelForCausalLM": "modeling_leviathan.LeviathanForCausalLM",
}
"""config.json's `auto_map`: the classes transformers loads with trust_remote_code=True."""

_PACKAGE_IMPORT = re.compile(r"^(\s*)from\s+(megatron_ext(?:\.\w+)*)\s+import\b", re.MULTILINE)


def _source_path(module: str) -> str:
    return os.path.join(os.path.dirname(_PACKAGE), *module.split(".")) + ".py"


def _localise(module: str, text: str) -> str:
    def local(match: re.Match) -> str:
        target = match.group(2)
        if target not in REMOTE_CODE_FILES:
            raise RuntimeError(
                f"{module} imports {target}, which a Hugging Face export does not carry; add it "
                "to remote_code.REMOTE_CODE_FILES or import it from transformers/torch"
            )
        return f"{match.group(1)}from .{REMOTE_CODE_FILES[target]} import"

    return _PACKAGE_IMPORT.sub(local, text)


def remote_code_sources() -> dict[str, str]:
    """File name (with .py) -> text of every modeling file of an export."""
    sources = {}
    for module, name in REMOTE_CODE_FILES.items():
        with open(_source_path(module), encoding="utf-8") as handle:
            text = handle.read()
        header = f"# Copied from {module} by megatron_ext's export-hf --hf-format leviathan.\n"
        sources[f"{name}.py"] = header + _localise(module, text)
    return sources


def write_remote_code(out_dir: str) -> list[str]:
    """Write the modeling files into `out_dir`; returns their names."""
    sources = remote_code_sources()
    for name, text in sources.items():
        atomic_write(os.path.join(out_dir, name), text)
    return sorted(sources)
