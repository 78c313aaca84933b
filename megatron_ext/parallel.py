"""Process-group and RNG set-up shared by the entry points, the tests and the benchmarks.

megatron.core.parallel_state owns the groups; this module only picks the backend (gloo on CPU,
nccl on CUDA), validates the layout with messages that say which flag to change, and seeds the
random generators the way Megatron-LM does (the CUDA RNG tracker on GPU; on CPU a tracker whose
`fork()` is a no-op, since megatron's tracker only knows CUDA generator states).
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel

logger = logging.getLogger(__name__)

__all__ = [
    "default_backend",
    "validate_parallel_layout",
    "initialize_parallel",
    "destroy_parallel",
    "find_free_port",
    "set_random_seed",
]


def find_free_port() -> int:
    """Return a TCP port on loopback that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def default_backend() -> str:
    """nccl when CUDA is usable, gloo otherwise."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def validate_parallel_layout(
    world_size: int,
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    context_parallel_size: int = 1,
) -> int:
    """Check that the ranks split into TP x CP x PP x DP; return the data-parallel size."""
    for name, value in (
        ("--tensor-model-parallel-size", tensor_model_parallel_size),
        ("--pipeline-model-parallel-size", pipeline_model_parallel_size),
        ("--context-parallel-size", context_parallel_size),
    ):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    model_parallel = (
        tensor_model_parallel_size * pipeline_model_parallel_size * context_parallel_size
    )
    if world_size % model_parallel != 0:
        raise ValueError(
            f"world size {world_size} is not divisible by tensor x pipeline x context parallel "
            f"size {tensor_model_parallel_size}x{pipeline_model_parallel_size}x"
            f"{context_parallel_size}={model_parallel}; change --nproc-per-node or the parallel "
            "sizes"
        )
    return world_size // model_parallel


def initialize_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    context_parallel_size: int = 1,
    backend: Optional[str] = None,
    timeout_minutes: int = 30,
) -> None:
    """Initialise torch.distributed (from torchrun's env vars) and megatron's parallel groups.

    Without torchrun's variables (a plain `python pretrain_leviathan.py`) the process is a
    one-rank world on a free loopback port, so several such runs can share a machine.
    """
    backend = backend or default_backend()
    if backend == "nccl" and not torch.cuda.is_available():
        raise RuntimeError("backend nccl needs CUDA; use gloo on CPU")
    if not dist.is_initialized():
        if "WORLD_SIZE" not in os.environ:
            os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(find_free_port()))
        rank = int(os.environ["RANK"])
        world_size = int(os.environ["WORLD_SIZE"])
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(
            backend=backend,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(minutes=timeout_minutes),
        )
    validate_parallel_layout(
        dist.get_world_size(),
        tensor_model_parallel_size,
        pipeline_model_parallel_size,
        context_parallel_size,
    )
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        context_parallel_size=context_parallel_size,
        distributed_timeout_minutes=timeout_minutes,
        # gloo twins of every group are only needed for NCCL runs that also talk over gloo.
        create_gloo_process_groups=backend == "nccl",
    )
    set_random_seed(1234)


def destroy_parallel() -> None:
    """Tear down megatron's groups (torch.distributed's default group is left to the caller)."""
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()


def set_random_seed(seed: int) -> None:
    """Seed like Megatron-LM's `_set_random_seed`: offset by pipeline rank, same across TP.

    Every tensor-parallel rank draws the same CPU stream, which megatron's
    `use_cpu_initialization` relies on to build the full master weight before splitting it.
    """
    if parallel_state.model_parallel_is_initialized():
        seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    else:
        # megatron's tracker stores CUDA generator states; on CPU dropout regions that ask it to
        # fork run on the default generator instead.
        tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
