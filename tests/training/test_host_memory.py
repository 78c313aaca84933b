"""`training.host_memory`: with the thresholds set, re-allocating tensors of varying sizes (a
training step's pattern) faults no fresh pages in after the first round; with glibc's defaults
every round does. Each case runs in a fresh process (the settings are per process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from megatron_ext.training.config import MemoryConfig

_SCRIPT = """
import json, resource, sys, torch
from megatron_ext.training.host_memory import retain_freed_host_memory
why_not = retain_freed_host_memory() if sys.argv[1] == "retain" else "not asked"
faults = []
for _ in range(3):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for mib in (3, 9, 5, 17, 2, 11, 7, 30, 4):
        kept = [torch.ones(mib << 18) for _ in range(4)]
        del kept
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"why_not": why_not, "faults": faults}))
"""


def _run(mode: str, **env: str) -> dict:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    clean.pop("GLIBC_TUNABLES", None)
    clean.pop("LD_PRELOAD", None)
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT, mode], env={**clean, **env}, capture_output=True,
        text=True, timeout=120, check=True,
    )  # fmt: skip
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.integration
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_retained_memory_is_reused_without_page_faults():
    default, retained = _run("default"), _run("retain")
    assert retained["why_not"] is None
    # 4 x (3 + 9 + ... + 4) MiB = 352 MiB per round: about 90k pages if all were fresh.
    assert min(default["faults"][1:]) > 10_000, default
    assert max(retained["faults"][1:]) < 1_000, retained


@pytest.mark.integration
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_the_users_allocator_settings_are_left_alone():
    chosen = _run("retain", MALLOC_ARENA_MAX="2")
    assert chosen["why_not"] == "the allocator settings of MALLOC_ARENA_MAX are left as they are"
    assert min(chosen["faults"][1:]) > 10_000, chosen


def test_flag():
    assert MemoryConfig().retain_host_memory is True
    field = MemoryConfig.__dataclass_fields__["retain_host_memory"]
    assert field.metadata["flag"] == "--no-retain-host-memory"
