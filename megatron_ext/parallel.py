"""Process-group and RNG set-up: megatron.core.parallel_state creates the groups; this module
picks the backend (gloo on CPU, nccl on CUDA), validates the layout, and seeds the random
generators the way Megatron-LM does (on CPU over `rng.CpuRNGStatesTracker`).

`initialize_parallel` returns the groups as one `ProcessGroups` object, which the rest of the
package takes as an argument: this module is the one place that reads megatron's globals
(tests/test_import_layers.py keeps it so).
"""

from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass, fields
from typing import Optional

import megatron_ext.megatron_import  # noqa: F401

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.process_groups_config import ProcessGroupCollection
from torch.distributed import distributed_c10d as c10d

from megatron_ext import placement, rng
from megatron_ext.config.layout import ParallelConfig
from megatron_ext.elastic import round_store, uses_agent_store

logger = logging.getLogger(__name__)

__all__ = [
    "ProcessGroups",
    "initialize_parallel",
    "destroy_parallel",
    "set_random_seed",
]


STARTUP_TIMEOUT_MINUTES = 10.0
"""The least time rendezvous and group creation wait for every rank (see initialize_parallel)."""


@dataclass(frozen=True)
class ProcessGroups:
    """The process groups of one rank, passed explicitly to the code that communicates.

    Names follow megatron-core's `ProcessGroupCollection`. Ranks and sizes are within each group;
    `embd` is None on ranks that hold no copy of a tied embedding (or with one pipeline stage).
    """

    tp: dist.ProcessGroup
    pp: dist.ProcessGroup  # the stages of this model replica
    cp: dist.ProcessGroup
    dp: dist.ProcessGroup  # without context parallelism
    dp_cp: dist.ProcessGroup  # gradients are averaged and ZeRO-1 shards over it
    mp: dist.ProcessGroup  # TP x PP: the global gradient norm sums over it
    # First and last pipeline stage, which both hold a tied embedding (this rank's, if any).
    embd: Optional[dist.ProcessGroup] = None

    @classmethod
    def from_megatron(cls) -> "ProcessGroups":
        """The groups megatron's `parallel_state` created (it must be initialised)."""
        if not parallel_state.model_parallel_is_initialized():
            raise RuntimeError("megatron's process groups are not initialised: initialize_parallel")
        embd = None
        if parallel_state.get_pipeline_model_parallel_world_size() > 1:
            group = parallel_state.get_embedding_group(check_initialized=False)
            if group is not None and dist.get_rank() in dist.get_process_group_ranks(group):
                embd = group
        return cls(
            tp=parallel_state.get_tensor_model_parallel_group(),
            pp=parallel_state.get_pipeline_model_parallel_group(),
            cp=parallel_state.get_context_parallel_group(),
            dp=parallel_state.get_data_parallel_group(),
            dp_cp=parallel_state.get_data_parallel_group(with_context_parallel=True),
            mp=parallel_state.get_model_parallel_group(),
            embd=embd,
        )

    @classmethod
    def current(cls) -> Optional["ProcessGroups"]:
        """megatron's groups when `parallel_state` is initialised, else None (tools that may
        be called again in the same process check what is already there)."""
        if not parallel_state.model_parallel_is_initialized():
            return None
        return cls.from_megatron()

    def megatron_collection(self):
        """These groups as megatron-core's `ProcessGroupCollection` (GPTModel's `pg_collection`),
        so that megatron's layers communicate over the same groups as this package's code."""
        return ProcessGroupCollection(**{f.name: getattr(self, f.name) for f in fields(self)})

    @classmethod
    def from_collection(cls, collection) -> "ProcessGroups":
        """The groups of a megatron-core `ProcessGroupCollection` (what Megatron-LM hands a
        `model_provider` as `pg_collection`); the inverse of `megatron_collection`."""
        names = [f.name for f in fields(cls) if f.name != "embd"]
        return cls(
            **{name: getattr(collection, name) for name in names},
            embd=getattr(collection, "embd", None),
        )

    @property
    def tp_rank(self) -> int:
        """This rank within the tensor-parallel group."""
        return dist.get_rank(self.tp)

    @property
    def tp_size(self) -> int:
        """Tensor-parallel size."""
        return dist.get_world_size(self.tp)

    @property
    def pp_rank(self) -> int:
        """This rank's pipeline stage."""
        return dist.get_rank(self.pp)

    @property
    def pp_size(self) -> int:
        """Number of pipeline stages."""
        return dist.get_world_size(self.pp)

    @property
    def cp_rank(self) -> int:
        """This rank within the context-parallel group."""
        return dist.get_rank(self.cp)

    @property
    def cp_size(self) -> int:
        """Context-parallel size."""
        return dist.get_world_size(self.cp)

    @property
    def dp_rank(self) -> int:
        """This rank within the data-parallel group."""
        return dist.get_rank(self.dp)

    @property
    def dp_size(self) -> int:
        """Data-parallel size (without CP)."""
        return dist.get_world_size(self.dp)

    @property
    def dp_cp_size(self) -> int:
        """Data x context-parallel size."""
        return dist.get_world_size(self.dp_cp)

    @property
    def is_first_stage(self) -> bool:
        """Whether this rank holds the first pipeline stage (the input embedding)."""
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        """Whether this rank holds the last pipeline stage (the output head and the loss)."""
        return self.pp_rank == self.pp_size - 1

    def pp_neighbour(self, offset: int) -> int:
        """The global rank of the pipeline stage `offset` stages away (wrapping around)."""
        ranks = dist.get_process_group_ranks(self.pp)
        return ranks[(self.pp_rank + offset) % len(ranks)]

    def layout(self) -> dict[str, int]:
        """{"tp", "pp", "cp", "dp"} sizes (the layout recorded in checkpoints)."""
        return dict(tp=self.tp_size, pp=self.pp_size, cp=self.cp_size, dp=self.dp_size)

    def coords(self) -> dict[str, int]:
        """{"pp", "tp", "cp", "dp"}: this rank's position in the layout."""
        return dict(pp=self.pp_rank, tp=self.tp_rank, cp=self.cp_rank, dp=self.dp_rank)


def initialize_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    context_parallel_size: int = 1,
    backend: Optional[str] = None,
    timeout_minutes: float = 30,
) -> ProcessGroups:
    """Initialise torch.distributed (from torchrun's env vars) and megatron's parallel groups;
    return this rank's groups (seeded with `set_random_seed(1234, ...)`).

    Without torchrun's variables the process is a one-rank world over an in-memory store (no
    port, `os.environ` left alone). `timeout_minutes` bounds every collective once the groups
    exist (a rank waiting on a stopped peer raises instead of hanging); start-up waits at least
    STARTUP_TIMEOUT_MINUTES.
    """
    startup = datetime.timedelta(minutes=max(timeout_minutes, STARTUP_TIMEOUT_MINUTES))
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl" and not torch.cuda.is_available():
        raise RuntimeError("backend nccl needs CUDA; use gloo on CPU")
    if not dist.is_initialized():
        store = None
        if "WORLD_SIZE" not in os.environ:
            # A one-rank world needs no rendezvous: an in-memory store, and nothing written to
            # os.environ, which every process this one starts would inherit as its identity.
            store, rank, world_size = dist.HashStore(), 0, 1
        else:
            rank = int(os.environ["RANK"])
            world_size = int(os.environ["WORLD_SIZE"])
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", "29500")
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        if store is None and uses_agent_store():
            # torchrun's store outlives a restart round: start in a key space of this round.
            store, token = round_store(rank, world_size, startup)
            logger.debug("torchrun round %s", token)
        dist.init_process_group(
            backend=backend,
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=startup,
        )
    sizes = (tensor_model_parallel_size, pipeline_model_parallel_size, context_parallel_size)
    ParallelConfig(*sizes).resolve(dist.get_world_size())  # refuses a layout that does not split
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        context_parallel_size=context_parallel_size,
        distributed_timeout_minutes=startup.total_seconds() / 60,
        # gloo twins of every group are only needed for NCCL runs that also talk over gloo.
        create_gloo_process_groups=backend == "nccl",
    )
    groups = ProcessGroups.from_megatron()
    dist.barrier()  # every rank is up: from now on a silent peer is a failure
    if dist.get_world_size() > 1:
        _log_placement(groups)
    _set_timeout(datetime.timedelta(minutes=timeout_minutes))
    set_random_seed(1234, groups.pp_rank)
    return groups


def _log_placement(groups: ProcessGroups) -> None:
    """Rank 0 logs which node runs which ranks, and warns when a tensor-parallel group spans
    nodes (its per-layer all-reduces would cross the slower inter-node network)."""
    table = placement.rank_placement(groups)
    if dist.get_rank() != 0:
        return
    for line in placement.describe(table):
        logger.info("placement: %s", line)
    spanning = placement.tp_groups_spanning_nodes(table)
    if spanning:
        logger.warning(
            "tensor-parallel groups %s span nodes: make the processes per node a multiple of "
            "--tensor-model-parallel-size %d",
            ", ".join(str(list(g)) for g in spanning),
            groups.tp_size,
        )


def _set_timeout(timeout: datetime.timedelta) -> None:
    """Set the timeout of every process group this rank belongs to (as Megatron-LM's
    --distributed-timeout-seconds-after-init does)."""
    for group in list(c10d._world.pg_map):
        if not c10d._rank_not_in_group(group):
            c10d._set_pg_timeout(timeout, group)


def is_collective_timeout(error: Optional[BaseException]) -> bool:
    """Whether `error`, or an error it was raised from, is a collective that waited past the
    process-group timeout (a RuntimeError saying so: gloo, NCCL's watchdog, torch's pipeline
    stages re-raising)."""
    while error is not None:
        text = str(error).lower()
        if isinstance(error, RuntimeError) and ("timed out" in text or "timeout" in text):
            return True
        error = error.__cause__
    return False


def group_description(group) -> str:
    """'ranks [0, 1]' of a torch.distributed group (the world for None)."""
    if group is None:
        return f"ranks 0..{dist.get_world_size() - 1}"
    return f"ranks {dist.get_process_group_ranks(group)}"


def destroy_parallel() -> None:
    """Tear down megatron's groups (torch.distributed's default group is left to the caller)."""
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()


def set_random_seed(seed: int, pp_rank: int = 0) -> None:
    """Seed like Megatron-LM's `_set_random_seed`: offset by the pipeline rank (`pp_rank`, from
    `ProcessGroups.pp_rank`), the same across TP; then megatron's RNG tracker
    (`model_parallel_cuda_manual_seed`: its model-parallel state differs per TP rank).

    Every TP rank draws the same CPU stream (megatron's `use_cpu_initialization` builds the full
    master weight before splitting it). Without CUDA the tracker is `rng.CpuRNGStatesTracker`.
    """
    seed = seed + 100 * pp_rank
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
        return
    tracker = rng.install_cpu_tracker()
    ranks = {}
    if not parallel_state.model_parallel_is_initialized():
        ranks = dict(tp_rank=0, ep_rank=0, etp_rank=0)
    # Its torch.cuda.manual_seed is queued, never run, without CUDA.
    tensor_parallel.model_parallel_cuda_manual_seed(seed, **ranks)
    tracker.manual_seed_device(seed)
