"""Dropout's CPU streams (`megatron_ext.rng`): megatron's RNG tracker over CPU generator states.

A fork draws from its own state and leaves the CPU generator as it was; the streams are seeded
as megatron seeds the CUDA ones; other draws from the CPU generator (a DataLoader iterator's
base seed) leave the dropout masks alone; a recomputation replays a fork's draws; and the
checkpoint's RNG file carries the streams (and an older file without them says so).
"""

from __future__ import annotations

import megatron_ext.megatron_import  # noqa: F401

import pytest
import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel

from megatron_ext import rng
from megatron_ext.checkpoint import format as ckpt_format
from megatron_ext.checkpoint.safe_load import load_rng_file, save_rng_file
from megatron_ext.parallel import set_random_seed

MODEL_PARALLEL = "model-parallel-rng"


def _draws(seed: int, n: int = 4, skip: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    torch.rand(skip, generator=generator)
    return torch.rand(n, generator=generator)


def test_fork_draws_from_its_state_and_leaves_the_cpu_generator_alone():
    tracker = rng.CpuRNGStatesTracker()
    tracker.add("a", 5)
    tracker.manual_seed_device(9)
    torch.manual_seed(0)
    outside = torch.get_rng_state()
    with tracker.fork("a"):
        first = torch.rand(4)
    assert torch.equal(torch.get_rng_state(), outside)
    with tracker.fork(rng.DEVICE_RNG):
        device = torch.rand(4)
        with tracker.fork("a"):  # nested: the outer stream resumes where it stopped
            second = torch.rand(4)
        device_after = torch.rand(4)
    assert torch.equal(torch.get_rng_state(), outside)
    assert torch.equal(first, _draws(5)) and torch.equal(second, _draws(5, skip=4))
    assert torch.equal(device, _draws(9)) and torch.equal(device_after, _draws(9, skip=4))
    with pytest.raises(ValueError, match="seed 5 already exists"):
        tracker.add("b", 5)


def test_streams_are_seeded_as_megatron_seeds_the_cuda_ones():
    set_random_seed(7, pp_rank=1)  # no process groups: TP rank 0
    tracker = tensor_parallel.get_cuda_rng_tracker()
    assert tracker is rng.cpu_tracker()
    seed = 7 + 100  # Megatron-LM's pipeline offset
    expected = {
        rng.DEVICE_RNG: seed,  # torch.cuda.manual_seed's
        "data-parallel-rng": seed,
        MODEL_PARALLEL: seed + 2718,  # + the TP rank
        "expert-parallel-rng": seed + 1024,
    }
    assert sorted(tracker.get_states()) == sorted(expected)
    for name, value in expected.items():
        assert torch.equal(
            tracker.get_states()[name], torch.Generator().manual_seed(value).get_state()
        )


def _dropout_masks(draw_between: bool) -> list[torch.Tensor]:
    set_random_seed(11)
    masks = []
    for _ in range(2):
        with rng.device_rng():
            masks.append(F.dropout(torch.ones(64), 0.5) != 0)
        if draw_between:  # what creating a DataLoader iterator does
            torch.empty((), dtype=torch.int64).random_()
    return masks


def test_other_draws_leave_the_dropout_masks_alone():
    quiet, busy = _dropout_masks(False), _dropout_masks(True)
    assert all(torch.equal(a, b) for a, b in zip(quiet, busy))
    assert not torch.equal(quiet[0], quiet[1])  # the stream advances


def test_a_recomputation_replays_a_forks_dropout():
    set_random_seed(3)
    tracker = tensor_parallel.get_cuda_rng_tracker()

    def block(x):
        with tracker.fork():  # attention dropout's fork, inside the recomputed block
            return F.dropout(x, 0.5)

    x = torch.ones(256, requires_grad=True)
    with rng.device_rng():
        out = rng.checkpoint(block, x)
        F.dropout(torch.ones(256), 0.5)  # later forwards advance the streams before backward
        with tracker.fork():
            torch.rand(256)
    out.sum().backward()
    # Recomputed with the forward's mask: the gradient is 2 where the output kept x, 0 elsewhere.
    assert torch.equal(x.grad, (out != 0).float() * 2)


def test_the_rng_file_carries_the_streams(tmp_path):
    set_random_seed(5)
    with rng.device_rng():
        torch.rand(3)
    state = ckpt_format._rng_state()
    assert sorted(state["cpu_tracker"]) == sorted(rng.cpu_tracker().get_states())
    save_rng_file(str(tmp_path / "rng.pt"), state)
    with rng.device_rng():
        expected = torch.rand(3)

    set_random_seed(6)
    assert ckpt_format._set_rng_state(load_rng_file(str(tmp_path / "rng.pt")))
    with rng.device_rng():
        assert torch.equal(torch.rand(3), expected)

    older = {k: v for k, v in state.items() if k != "cpu_tracker"}  # saved before the streams
    assert not ckpt_format._set_rng_state(older)
