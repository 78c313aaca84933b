"""Megatron-Core extension for Leviathan language models."""

import logging as _logging
import os as _os
import subprocess as _subprocess

# megatron-core announces Megatron-FSDP at INFO ("Detected Megatron Core, using Megatron-FSDP
# with Megatron.", twice) whenever anything imports its distributed package; this project never
# uses Megatron-FSDP, so every tool's output would start with that noise.
_logging.getLogger("megatron.core.distributed.fsdp").setLevel(_logging.WARNING)


def git_revision() -> str:
    """This checkout's commit, with "-dirty" when tracked files changed ("unknown" outside git,
    as in an installed wheel): the provenance that runs log and exports record."""
    root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
    command = ["git", "describe", "--always", "--dirty", "--abbrev=40", "--exclude=*"]
    try:
        out = _subprocess.run(command, cwd=root, capture_output=True, text=True, timeout=5)
    except (OSError, _subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 else "unknown"
