"""LEVEmbedding: the tensor-parallel LEV module, a drop-in for VocabParallelEmbedding.

    forward(input_ids [b, s]) -> [b, s, D]     TP-all-reduced   (reduce_scatter_embeddings=False)
                              -> [s/tp, b, D]  reduce-scattered (reduce_scatter_embeddings=True)

Each TP rank owns h/tp whole heads (dim-0 slices of seed_proj, seed_norm_*, spline_delta,
out_proj); the codebooks are replicated, their gradient summed over the TP group. LEV runs
once per distinct id of the micro-batch or, with `LEVConfig.dedup_global_batch`, of the global
batch (`begin_global_batch` / `end_global_batch`: LEV's backward runs once, after the
schedule). With `LEVConfig.eval_table`, eval forwards without gradient read a [V, D] table
(`lev.table`), rebuilt whenever a parameter changes (once per `pinned_eval_table`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
from typing import Iterator, Optional

import megatron_ext.megatron_import  # noqa: F401

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel import (
    copy_to_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    set_tensor_model_parallel_attributes,
)
from megatron.core.transformer import TransformerConfig
from megatron.core.utils import (
    get_pg_rank,
    get_pg_size,
    make_sharded_tensor_for_checkpoint,
    make_tp_sharded_tensor_for_checkpoint,
)

from megatron_ext.config.lev import LEV_PARAMETER_GROUPS, LEVConfig
from megatron_ext.lev import math as lev_math
from megatron_ext.lev.kernels import lev_modes
from megatron_ext.lev.table import LEVTable
from megatron_ext.tensor_parallel import check_sequence_split
from megatron_ext.tensor_parallel import (
    reduce_scatter_to_sequence_parallel_region as portable_reduce_scatter,
)

logger = logging.getLogger(__name__)

__all__ = [
    "LEVEmbedding",
    "LEV_PARAMETER_NAMES",
    "LEV_TP_PARTITION_DIMS",
    "embedding_std",
    "std_probe_ids",
]

LEV_TP_PARTITION_DIMS: dict[str, Optional[int]] = {
    "codebooks": None,
    "seed_proj": 0,
    "seed_norm_weight": 0,
    "seed_norm_bias": 0,
    "spline_delta": 0,
    "out_proj": 0,
}
"""Parameter name -> tensor-parallel partition dim (None: replicated on every TP rank)."""

LEV_PARAMETER_NAMES = tuple(LEV_TP_PARTITION_DIMS)
"""The parameters of LEVEmbedding, in registration order (docs/design.md "Fixed contracts")."""

_STD_PROBE_IDS = 8192


def std_probe_ids(vocab_size: int) -> torch.Tensor:
    """The ids whose embeddings `embedding_std` measures: all of them up to _STD_PROBE_IDS ids,
    else _STD_PROBE_IDS ids evenly spaced over [0, V) (every digit value of every position)."""
    if vocab_size <= _STD_PROBE_IDS:
        return torch.arange(vocab_size)
    return torch.linspace(0, vocab_size - 1, _STD_PROBE_IDS, dtype=torch.float64).long()


@torch.no_grad()
def embedding_std(lev_config: LEVConfig, params: dict[str, torch.Tensor]) -> float:
    """Std of all entries of the LEV embeddings of `std_probe_ids` (float32, torch kernel), of
    the full (TP=1) parameters by name (`LEVConfig.parameter_shapes(1)`)."""
    lc = lev_config
    ids = std_probe_ids(lc.vocab_size)
    digits = lev_math.to_digits(ids, lc.base, lc.num_digits)
    z = lev_math.seed(params["codebooks"].float(), digits, lc.codebook_combine)
    names = ("seed_proj", "seed_norm_weight", "seed_norm_bias", "spline_delta")
    modes = lev_modes(z, *(params[n].float() for n in names), lc, kernel="torch")
    std = float(lev_math.lev_embed(modes, params["out_proj"].float()).double().std())
    if not std > 0:
        raise ValueError(
            "--lev-init-output-std: the initial LEV embeddings have zero spread (std "
            f"{std}); raise --lev-init-std / --lev-spline-init-std"
        )
    return std


class LEVEmbedding(torch.nn.Module):
    """LEV input generator with VocabParallelEmbedding's interface (and the engines'
    `training.engine.ModuleHooks`: timing spans "lev-*", optimizer settings, global-batch dedup).

    Args:
        lev_config: LEV hyper-parameters (vocab size V, width D, heads, ...).
        config: megatron TransformerConfig (params_dtype, use_cpu_initialization,
            perform_initialization; tensor_model_parallel_size must match `tp_group`).
        tp_group: the tensor-parallel group (`ProcessGroups.tp`); None: every head here, no
            communication. Nothing is read from megatron's globals.
        reduce_scatter_embeddings: return [s/tp, b, D] reduce-scattered along the sequence
            (sequence parallelism) instead of [b, s, D].
    """

    def __init__(
        self,
        lev_config: LEVConfig,
        *,
        config: TransformerConfig,
        tp_group: Optional[torch.distributed.ProcessGroup] = None,
        reduce_scatter_embeddings: bool = False,
    ):
        super().__init__()
        self.lev_config = lev_config
        self.config = config
        self.reduce_scatter_embeddings = reduce_scatter_embeddings
        self.tp_group = tp_group
        self.tp_size = get_pg_size(self.tp_group)
        self.tp_rank = get_pg_rank(self.tp_group)
        # VocabParallelEmbedding's public attributes, for code that inspects word_embeddings.
        self.num_embeddings = lev_config.vocab_size
        self.embedding_dim = lev_config.hidden_size
        if lev_config.hidden_size != config.hidden_size:
            raise ValueError(
                f"LEV hidden size {lev_config.hidden_size} differs from the model's "
                f"--hidden-size {config.hidden_size}; build LEVConfig with the model's width"
            )
        cfg_tp = getattr(config, "tensor_model_parallel_size", 1) or 1
        if cfg_tp != self.tp_size:
            raise ValueError(
                f"TransformerConfig.tensor_model_parallel_size={cfg_tp} but the TP group has "
                f"{self.tp_size} ranks (tp_group=None: 1); pass the matching tp_group"
            )
        shapes = lev_config.parameter_shapes(self.tp_size)
        self.num_local_heads = lev_config.heads_per_rank(self.tp_size)

        if config.use_cpu_initialization or not torch.cuda.is_available():
            device = torch.device("cpu")
        else:
            device = torch.device("cuda", torch.cuda.current_device())
        dtype = config.params_dtype
        for name in LEV_PARAMETER_NAMES:
            param = torch.nn.Parameter(torch.empty(shapes[name], device=device, dtype=dtype))
            dim = LEV_TP_PARTITION_DIMS[name]
            set_tensor_model_parallel_attributes(
                param, is_parallel=dim is not None, dim=-1 if dim is None else dim, stride=1
            )
            self.register_parameter(name, param)
        if config.perform_initialization:
            self.reset_parameters()
        else:
            with torch.no_grad():
                self.seed_norm_weight.fill_(1.0)
                self.seed_norm_bias.zero_()

        self._table: Optional[torch.Tensor] = None
        self._table_key: Optional[tuple] = None
        self._table_snapshot: Optional[list[torch.Tensor]] = None
        self._global_batch: Optional[_GlobalBatchRows] = None

    # ------------------------------------------------------------------ parameters

    def reset_parameters(self) -> None:
        """Initialise as docs/lev.md section 2 says, identically for every TP layout: every
        rank draws the full TP=1 tensors from the default CPU generator in the order of
        LEV_PARAMETER_NAMES and keeps its heads. With `LEVConfig.init_output_std` the full
        out_proj is scaled so that the embeddings of `std_probe_ids` have that std.
        """
        lc = self.lev_config
        full = lc.parameter_shapes(1)
        stds = {
            "codebooks": lc.init_std,
            "seed_proj": lc.init_std,
            "spline_delta": lc.spline_init_std,
            "out_proj": lc.init_std / math.sqrt(lc.num_heads),
        }
        masters = {  # drawn in this order; the seed LayerNorm starts as the identity (1, 0)
            name: torch.empty(full[name]).normal_(0.0, stds[name])
            if name in stds
            else torch.full(full[name], float(name == "seed_norm_weight"))
            for name in LEV_PARAMETER_NAMES
        }
        if lc.init_output_std is not None:
            # e is linear in out_proj: one rescale sets the std exactly (on the measured ids).
            masters["out_proj"] *= lc.init_output_std / embedding_std(lc, masters)
        heads = slice(
            self.tp_rank * self.num_local_heads, (self.tp_rank + 1) * self.num_local_heads
        )
        with torch.no_grad():
            for name, master in masters.items():
                getattr(self, name).copy_(
                    master if LEV_TP_PARTITION_DIMS[name] is None else master[heads]
                )

    def tp_partition_dims(self) -> dict[str, Optional[int]]:
        """Parameter name -> TP partition dim, or None when replicated (from the attributes)."""
        return {
            name: (p.partition_dim if getattr(p, "tensor_model_parallel", False) else None)
            for name, p in self.named_parameters()
        }

    def sharded_state_dict(
        self,
        prefix: str = "",
        sharded_offsets: tuple = (),
        metadata: Optional[dict] = None,
    ) -> dict:
        """Megatron distributed-checkpoint view: codebooks replicated, the rest TP-sharded on 0;
        `metadata["dp_cp_group"]` (the model's `sharded_state_dict` fills it in) sets the
        replica ids."""
        dp_cp_group = (metadata or {}).get("dp_cp_group")
        if dp_cp_group is None:
            raise ValueError(
                "LEVEmbedding.sharded_state_dict needs metadata={'dp_cp_group': ...} "
                "(ProcessGroups.dp_cp); the model's sharded_state_dict passes it"
            )
        kwargs = dict(prepend_offsets=sharded_offsets, tp_group=self.tp_group)
        sharded = {}
        for name, tensor in self.state_dict(prefix="", keep_vars=True).items():
            key, dim = f"{prefix}{name}", LEV_TP_PARTITION_DIMS.get(name)
            if dim is None:
                make = make_sharded_tensor_for_checkpoint
            else:
                make = functools.partial(make_tp_sharded_tensor_for_checkpoint, tp_axis=dim)
            sharded[key] = make(tensor, key, dp_cp_group=dp_cp_group, **kwargs)
        return sharded

    # ------------------------------------------------------------------ forward

    def partial_embeddings(self, ids: torch.Tensor) -> torch.Tensor:
        """This rank's heads' share [U, D] of the embeddings of ids [U] (in [0, V), not checked),
        float32 (float64 for float64 parameters); summed over the TP ranks, the full embedding."""
        with torch.autocast(device_type=ids.device.type, enabled=False):
            return lev_math.lev_embed(self._modes(ids), self.out_proj)  # [U, D]

    def _modes(self, ids: torch.Tensor, modes: Optional[torch.Tensor] = None) -> torch.Tensor:
        """This rank's modes M [U, h_local, r] of `ids` [U] (steps 2-3e), autocast off; with
        `modes` (computed by this method before, under no_grad), only their autograd graph."""
        lc = self.lev_config
        cdt = lev_math.compute_dtype(self.codebooks.dtype)
        digits = lev_math.to_digits(ids, lc.base, lc.num_digits)
        codebooks = self.codebooks.to(cdt)
        # More ids than codebook rows: project the k*b rows once and sum k of them per id
        # (`lev.kernels.digit_sum`), instead of projecting U seeds.
        by_digit = lc.projects_by_digit(ids.shape[0])
        z = codebooks if by_digit else lev_math.seed(codebooks, digits, lc.codebook_combine)
        if self.tp_size > 1:
            # Every head on every rank consumes z: sum its gradient over the TP group.
            z = copy_to_tensor_model_parallel_region(z, group=self.tp_group)
        params = (self.seed_proj, self.seed_norm_weight, self.seed_norm_bias, self.spline_delta)
        digits = digits if by_digit else None
        return lev_modes(z, *params, lc, kernel=lc.kernel, digits=digits, modes=modes)

    def _backward_rows(self, ids: torch.Tensor, modes: torch.Tensor, grad: torch.Tensor) -> None:
        """LEV's backward for the rows `partial_embeddings(ids)` computed from `modes` [U, h, r]
        (`_modes` under no_grad), given their gradient `grad` [U, D]: accumulates into the
        parameters' .grad (and all-reduces the codebooks' share over the TP group)."""
        with torch.autocast(device_type=ids.device.type, enabled=False):
            n, h, r = modes.shape
            grad = grad.to(modes.dtype)
            weight = self.out_proj.to(modes.dtype).reshape(h * r, -1)
            # Step 4's backward by hand (its forward, rows = M @ W_out, is not run again).
            grad_modes = torch.matmul(grad, weight.t()).view(n, h, r)
            grad_out_proj = torch.matmul(modes.reshape(n, h * r).t(), grad)
            graph = self._modes(ids, modes)
            torch.autograd.backward(
                [graph, self.out_proj],
                [grad_modes, grad_out_proj.view_as(self.out_proj).to(self.out_proj.dtype)],
            )

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [b, s] in [0, V), the same on every TP rank -> [b, s, D] summed over the TP
        group or, with reduce_scatter_embeddings, [s/tp, b, D] reduce-scattered along s; in
        config.params_dtype, also under autocast."""
        if input_ids.dim() != 2:
            raise ValueError(f"LEV expects input_ids of shape [b, s], got {tuple(input_ids.shape)}")
        lev_math.check_ids(input_ids, self.lev_config.vocab_size)
        b, s = input_ids.shape
        if self.reduce_scatter_embeddings:
            check_sequence_split(s, self.tp_size)
        # The parameters' dtype, whatever the autocast state: like a lookup table's output, and
        # so that the TP reduction sums fp32 partial embeddings (training/precision.py).
        out_dtype = self.config.params_dtype

        if self._use_eval_table():
            table = self._eval_table(out_dtype)
            rows, index = table, input_ids
        else:
            if self.lev_config.dedup:
                unique_ids, index = torch.unique(input_ids, sorted=True, return_inverse=True)
            else:
                unique_ids = input_ids.reshape(-1)
                index = torch.arange(b * s, device=input_ids.device).view(b, s)
            if self._global_batch is not None and torch.is_grad_enabled():
                # The global batch's rows so far ([U_seen, D]) and where these ids are in them.
                rows, positions = self._global_batch.rows(self, unique_ids, out_dtype)
                index = positions[index]
            else:
                rows = self.partial_embeddings(unique_ids).to(out_dtype)  # [U, D]

        if self.reduce_scatter_embeddings:
            # Gather straight into Megatron's [s, b, D] layout (no separate transpose copy).
            output = F.embedding(index.t(), rows)
            if self.tp_size == 1:
                return output
            if output.is_cuda:
                return reduce_scatter_to_sequence_parallel_region(output, group=self.tp_group)
            # megatron's reduce-scatter allocates its output on CUDA; same collective on CPU.
            return portable_reduce_scatter(output, self.tp_group)
        if self.tp_size == 1:
            return F.embedding(index, rows)
        if rows.shape[0] < b * s:
            # Summing the distinct rows before the gather moves U*D numbers instead of N*D.
            rows = reduce_from_tensor_model_parallel_region(rows, group=self.tp_group)
            return F.embedding(index, rows)
        output = F.embedding(index, rows)
        return reduce_from_tensor_model_parallel_region(output, group=self.tp_group)

    # ------------------------------------------------------- the engines' ModuleHooks

    engine_name = "lev"

    def param_settings(self) -> dict[int, tuple[bool, float]]:
        """id(parameter) -> (weight decay?, lr multiplier): --lev-weight-decay-groups and
        --lev-lr-mult (the optimizer's `param_groups` reads it)."""
        lc = self.lev_config
        return {
            id(getattr(self, name)): (group in lc.weight_decay_groups, lc.lr_mult)
            for group, names in LEV_PARAMETER_GROUPS.items()
            for name in names
        }

    def begin_global_batch(self) -> None:
        """Start evaluating LEV once per distinct id of the global batch (see the module doc):
        until `end_global_batch`, forwards with autograd enabled compute only new ids' rows.
        A no-op unless `defers_gradients`."""
        if self.defers_gradients:
            self._global_batch = _GlobalBatchRows()

    @property
    def defers_gradients(self) -> bool:
        """Whether `begin_global_batch` takes effect (`LEVConfig.dedup` and
        `LEVConfig.dedup_global_batch`): the gradients arrive in `end_global_batch`."""
        return self.lev_config.dedup and self.lev_config.dedup_global_batch

    def end_global_batch(self) -> None:
        """Run LEV's backward for every row of the global batch with the gradient all its
        micro-batches' backwards left in them (collective over the TP group, like the
        per-micro-batch backward), and return to per-micro-batch evaluation."""
        pending, self._global_batch = self._global_batch, None
        if pending is not None:
            pending.backward(self)

    def abort_global_batch(self) -> None:
        """Drop the global batch's rows and their graph without a backward (a failed step)."""
        self._global_batch = None

    # ------------------------------------------------------------------ eval table

    def _use_eval_table(self) -> bool:
        if not self.lev_config.eval_table or self.training:
            return False
        return not (torch.is_grad_enabled() and any(p.requires_grad for p in self.parameters()))

    def _table_key_now(self, out_dtype: torch.dtype) -> tuple:
        return (out_dtype,) + tuple(
            (p.data_ptr(), p._version, p.dtype, p.device) for p in self.parameters()
        )

    def _table_fresh(self, out_dtype: torch.dtype) -> bool:
        """Whether the table was built from the current parameters, in `out_dtype`.

        The key (storage pointers and version counters) catches in-place optimizer steps and
        load_state_dict; the value snapshot (about 2M numbers, compared exactly) also catches
        writes through `.data`, which bypass the version counters.
        """
        return (
            self._table is not None
            and self._table_key_now(out_dtype) == self._table_key
            and all(torch.equal(p, q) for p, q in zip(self.parameters(), self._table_snapshot))
        )

    def _eval_table(self, out_dtype: torch.dtype) -> torch.Tensor:
        """The [V, D] table of this rank's partial embeddings, rebuilt if parameters changed."""
        if self._table_pinned and self._table is not None and self._table_key[0] == out_dtype:
            return self._table
        if not self._table_fresh(out_dtype):
            self.rebuild_eval_table(out_dtype)
        return self._table

    _table_pinned = False

    @contextlib.contextmanager
    def pinned_eval_table(self) -> Iterator[None]:
        """Promise that the parameters do not change inside the block (generation, evaluation).

        The table's freshness is checked on entry (a stale one is dropped) and by the forward
        that builds it, not at every forward: the exact comparison with the snapshot costs as
        much as several decoding steps of a small model.
        """
        previous = self._table_pinned
        if self._table is not None and not self._table_fresh(self._table_key[0]):
            self.drop_eval_table()
        self._table_pinned = True
        try:
            yield
        finally:
            self._table_pinned = previous

    @torch.no_grad()
    def rebuild_eval_table(self, out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """Materialise this rank's [V, D] partial table now (called lazily by eval forwards).

        Computed by `lev.table` (batched no-grad math, float32; float64 for float64
        parameters), which equals `partial_embeddings` up to rounding.
        """
        device = self.codebooks.device
        out_dtype = out_dtype or self.config.params_dtype
        vocab = self.lev_config.vocab_size
        logger.info(
            "building the LEV eval table [%d, %d] (%s)", vocab, self.embedding_dim, out_dtype
        )
        self._table = None
        table = torch.empty(vocab, self.embedding_dim, dtype=out_dtype, device=device)
        compute = lev_math.compute_dtype(self.codebooks.dtype)
        LEVTable(self.lev_config, dict(self.named_parameters()), dtype=compute).table(out=table)
        self._table = table
        self._table_key = self._table_key_now(out_dtype)
        self._table_snapshot = [p.detach().clone() for p in self.parameters()]
        return table

    def drop_eval_table(self) -> None:
        """Free the eval table (it is rebuilt on the next eval forward that uses it)."""
        self._table = self._table_key = self._table_snapshot = None

    def train(self, mode: bool = True):
        """Leaving eval mode frees the table: it would be stale after the next step anyway."""
        if mode:
            self.drop_eval_table()
        return super().train(mode)

    def extra_repr(self) -> str:
        """The hyper-parameters and this rank's share of the heads, for `print(model)`."""
        lc = self.lev_config
        return (
            f"V={lc.vocab_size}, D={lc.hidden_size}, k={lc.num_digits}, b={lc.base}, "
            f"d_seed={lc.seed_dim}, kappa={lc.num_knots}, r={lc.rank}, "
            f"heads={self.num_local_heads}/{lc.num_heads} (tp {self.tp_rank}/{self.tp_size}), "
            f"combine={lc.codebook_combine}, kernel={lc.kernel}, dedup={lc.dedup}"
        )


class _GlobalBatchRows:
    """The LEV rows one global batch has computed so far (`LEVEmbedding.begin_global_batch`):
    each forward computes new ids' modes and rows without autograd and keeps the rows as a leaf
    whose gradient the micro-batches' backwards accumulate; `backward` then runs LEV's backward
    once for all rows (one kernel call, one TP all-reduce, instead of one per forward).
    """

    def __init__(self) -> None:
        self.ids: list[torch.Tensor] = []  # [U_new] per forward that met new ids
        self.modes: list[torch.Tensor] = []  # [U_new, h, r]
        self.leaves: list[torch.Tensor] = []  # [U_new, D], requires grad
        self.position: Optional[torch.Tensor] = None  # [V]: id -> row in the leaves, or -1
        self.count = 0

    def rows(
        self, module: LEVEmbedding, unique_ids: torch.Tensor, out_dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A new tensor of the leaves' rows [U_seen, D] (computing those of ids not seen
        before; new because the TP reduction sums its input in place) and the position of each
        of `unique_ids` [U] (sorted, distinct) in it."""
        if self.position is None:
            vocab = module.lev_config.vocab_size
            self.position = torch.full((vocab,), -1, dtype=torch.long, device=unique_ids.device)
        positions = self.position[unique_ids]
        new = unique_ids[positions < 0]
        if new.numel() > 0:
            with torch.no_grad(), torch.autocast(device_type=new.device.type, enabled=False):
                modes = module._modes(new)
                computed = lev_math.lev_embed(modes, module.out_proj).to(out_dtype)
            self.ids.append(new)
            self.modes.append(modes)
            self.leaves.append(computed.requires_grad_())
            self.position[new] = torch.arange(
                self.count, self.count + new.numel(), device=new.device
            )
            self.count += new.numel()
            positions = self.position[unique_ids]
        return torch.cat(self.leaves), positions

    def backward(self, module: LEVEmbedding) -> None:
        """LEV's backward for all rows, once, if any leaf received a gradient (a leaf that got
        none, e.g. of a micro-batch whose loss was all masked, contributes zeros)."""
        leaves, ids, modes = self.leaves, self.ids, self.modes
        self.leaves, self.ids, self.modes, self.position = [], [], [], None
        if all(leaf.grad is None for leaf in leaves):
            return
        grad = torch.cat(
            [leaf.grad if leaf.grad is not None else torch.zeros_like(leaf) for leaf in leaves]
        )
        module._backward_rows(torch.cat(ids), torch.cat(modes), grad)
