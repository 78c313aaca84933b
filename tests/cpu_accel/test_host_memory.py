"""`cpu_accel.host_memory`: with the thresholds set, re-allocating tensors of varying sizes (a
training step's pattern) faults no fresh pages in after the first rounds; with glibc's default
thresholds held (MALLOC_MMAP_THRESHOLD_=131072: every block above 128 KiB mapped afresh) every
round does. glibc's defaults as they stand move the threshold up as mapped blocks are freed, so
whether and when they settle depends on the heap's layout (seen on one machine: faults in every
round; on another: none after round 3), which is why they are not the baseline. How many pages
the kept heap still grows by in the first rounds depends on the heap the imports left (seen: 0
to 4 rounds of 5k to 20k pages), so the runs are compared by their totals. Each case runs in a
fresh process (the settings are per process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from megatron_ext import cpu_accel
from megatron_ext.config.flags import flag_name
from megatron_ext.config.run import MemoryConfig
from megatron_ext.cpu_accel import host_memory
from megatron_ext.training import run_extras

_SCRIPT = """
import json, resource, sys, threading, torch
# As a training run: the training code (megatron-core with it) imported first. The heap it
# leaves decides whether the first rounds grow it once more (with less imported, a second
# round of 34816 faults in six of eight runs, none after).
import megatron_ext.training.run_extras
from megatron_ext.cpu_accel.host_memory import retain_freed_host_memory
mode, sizes = sys.argv[1], [int(m) for m in sys.argv[2].split(",")]
if mode == "default":
    why_not = "not asked"
else:
    why_not = retain_freed_host_memory(large_blocks=mode == "large")
faults = []
for _ in range(8):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for mib in sizes:
        kept = [torch.ones(mib << 18) for _ in range(4)]
        del kept
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
# A block larger than a thread's arena (64 MiB) is still allocated (glibc maps it).
in_thread = []
worker = threading.Thread(target=lambda: in_thread.append(float(torch.ones(100 << 18).sum())))
worker.start()
worker.join()
print(json.dumps({"why_not": why_not, "faults": faults, "in_thread": in_thread}))
"""


_SMALL = "3,9,5,17,2,11,7,30,4"  # MiB, all below glibc's largest mmap threshold (32 MiB)
_LARGE = "40,64,48,33,56"  # MiB, all above it: the size of a CPU step's [s, b, V] logits
_HELD_DEFAULT = {"MALLOC_MMAP_THRESHOLD_": "131072"}  # glibc's default threshold, held


def _run(mode: str, sizes: str = _SMALL, **env: str) -> dict:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    clean.pop("GLIBC_TUNABLES", None)
    clean.pop("LD_PRELOAD", None)
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT, mode, sizes], env={**clean, **env}, capture_output=True,
        text=True, timeout=900, check=True,
    )  # fmt: skip
    return json.loads(done.stdout.strip().splitlines()[-1])


def _assert_settles(kept: dict, baseline: dict) -> None:
    """The kept run reuses its heap (a later round faults nothing in) and faults a quarter of the
    pages or fewer; the baseline run faults fresh pages in every round."""
    assert min(baseline["faults"][1:]) > 1_000, baseline
    assert min(kept["faults"][1:]) < 1_000, kept
    assert 4 * sum(kept["faults"][1:]) < sum(baseline["faults"][1:]), (kept, baseline)


@pytest.mark.integration
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_retained_memory_is_reused_without_page_faults():
    # 4 x (3 + 9 + ... + 4) MiB = 352 MiB per round: about 90k pages if all were fresh.
    held, retained = _run("default", **_HELD_DEFAULT), _run("retain")
    assert retained["why_not"] is None
    _assert_settles(retained, held)


@pytest.mark.integration
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_large_blocks_are_kept_on_request():
    # 4 x 241 MiB per round: about 62k pages if all were fresh.
    thresholds, large = _run("retain", _LARGE), _run("large", _LARGE)
    assert large["why_not"] is None
    _assert_settles(large, thresholds)
    assert large["in_thread"] == [float(100 << 18)], large


@pytest.mark.integration
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_the_users_allocator_settings_are_left_alone():
    chosen, retained = _run("retain", **_HELD_DEFAULT), _run("retain")
    why_not = "the allocator settings of MALLOC_MMAP_THRESHOLD_ are left as they are"
    assert chosen["why_not"] == why_not
    _assert_settles(retained, chosen)
    arena = _run("retain", "3", MALLOC_ARENA_MAX="2", GLIBC_TUNABLES="glibc.malloc.tcache_count=0")
    assert arena["why_not"] == (
        "the allocator settings of GLIBC_TUNABLES, MALLOC_ARENA_MAX are left as they are"
    )


def test_flag():
    assert MemoryConfig().retain_host_memory is True
    field = MemoryConfig.__dataclass_fields__["retain_host_memory"]
    assert flag_name(field) == "--no-retain-host-memory"


@pytest.mark.parametrize("cuda", [False, True])
def test_the_run_keeps_large_blocks_on_cpu_only(monkeypatch, cuda):
    asked = []
    monkeypatch.setattr(host_memory, "retain_freed_host_memory", lambda **kw: asked.append(kw))
    monkeypatch.setattr(run_extras.torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(run_extras.dist, "get_rank", lambda: 0)
    run = SimpleNamespace(
        log=SimpleNamespace(tensorboard_dir=None, wandb_project=None),
        memory=MemoryConfig(),
        batch=SimpleNamespace(global_batch_size=8, rampup=lambda dp: None),
        parallel=SimpleNamespace(data_parallel_size=1),
        ckpt=SimpleNamespace(save=None),
    )
    run_extras.RunExtras(run)
    assert asked == [{"large_blocks": not cuda}]
    asked.clear()
    # A rank with the 1.2B shape's parameters maps its largest blocks on CPU too.
    run_extras.RunExtras(run, param_bytes=host_memory.LARGE_BLOCKS_PARAM_LIMIT)
    assert asked == [{"large_blocks": False}]
    asked.clear()
    run_extras.RunExtras(
        SimpleNamespace(**{**vars(run), "memory": MemoryConfig(retain_host_memory=False)})
    )
    assert asked == []
    # The CPU accelerations off: glibc's defaults, whatever --no-retain-host-memory says.
    monkeypatch.setenv(cpu_accel.ENV, "0")
    run_extras.RunExtras(run)
    assert asked == []
