"""Per-token losses and log-probabilities of a loaded checkpoint, at any TP x PP layout.

Every rank of the tool's world (TP x PP ranks, no data parallelism) sees the same batch. Under
TP the model's vocab-parallel cross entropy gives the per-token loss without gathering logits;
under PP the stages pass [s, b, h] activations forward point-to-point and the last stage
broadcasts the result, so every rank returns the same tensor. Everything runs under
`torch.inference_mode` (no autograd; LEV looks ids up in its eval table).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Iterator, Optional, Protocol

import numpy as np
import torch
import torch.distributed as dist
from tqdm.auto import tqdm

if TYPE_CHECKING:
    from megatron_ext.parallel import ProcessGroups

logger = logging.getLogger(__name__)

__all__ = [
    "Batch",
    "LoadedModel",
    "ModelScorer",
    "TokenConsumer",
    "load_for_evaluation",
    "score_batches",
]


@dataclass
class Batch:
    """One micro-batch of sequences to score (Megatron's sample layout, batch-first)."""

    tokens: torch.Tensor
    """[b, s] input ids."""
    labels: torch.Tensor
    """[b, s] target ids (the next token of each input)."""
    loss_mask: torch.Tensor
    """[b, s] 1.0 where the target is scored, 0.0 for padding."""
    position_ids: torch.Tensor
    """[b, s]."""
    attention_mask: Optional[torch.Tensor] = None

    @property
    def num_targets(self) -> int:
        """Number of scored targets: the sum of `loss_mask` [b, s]."""
        return int(self.loss_mask.sum().item())


class TokenConsumer(Protocol):
    """Receives the scored targets of each batch (e.g. a perplexity sum, frequency bins)."""

    def update(self, targets: np.ndarray, losses: np.ndarray) -> None:
        """targets: [n] int64 ids; losses: [n] float64 negative log-likelihoods (nats)."""


class ModelScorer:
    """Runs this rank's stage of the eval-mode `model` forward-only and returns what the last
    stage computed: PP activations [s, b, `hidden_size`] over `pg.pp`, vocab-parallel logits
    over `pg.tp`; ids at or above `vocab_size` (padding) are never predicted."""

    def __init__(
        self, model: torch.nn.Module, hidden_size: int, vocab_size: int, pg: "ProcessGroups"
    ) -> None:
        self.model = model
        self.hidden_size = hidden_size
        self.vocab_size = vocab_size
        self.pg = pg
        self.device = next(model.parameters()).device
        self.pp = pg.pp_size
        self.first = pg.is_first_stage
        self.last = pg.is_last_stage
        if self.pp > 1:
            self.pp_group = pg.pp
            self.last_rank = dist.get_process_group_ranks(pg.pp)[-1]
            self.prev = None if self.first else pg.pp_neighbour(-1)
            self.next = None if self.last else pg.pp_neighbour(1)
        self.tp_group = pg.tp
        self.tp = pg.tp_size
        self.tp_rank = pg.tp_rank

    def _run(self, tokens, position_ids, attention_mask, labels) -> Optional[torch.Tensor]:
        tokens = tokens.to(self.device)
        position_ids = position_ids.to(self.device)
        if attention_mask is not None:
            attention_mask = attention_mask.to(self.device)
        if labels is not None:
            labels = labels.to(self.device)
        if self.pp > 1:
            b, s = tokens.shape
            if not self.first:
                hidden = torch.empty(s, b, self.hidden_size, device=self.device)
                dist.recv(hidden, src=self.prev)
                self.model.set_input_tensor(hidden)
            else:
                self.model.set_input_tensor(None)
        out = self.model(tokens, position_ids, attention_mask, labels=labels if self.last else None)
        if self.pp > 1 and not self.last:
            dist.send(out.float().contiguous(), dst=self.next)
            return None
        return out

    def _from_last_stage(self, out: Optional[torch.Tensor], shape, dtype) -> torch.Tensor:
        if self.pp == 1:
            return out
        buffer = (
            out.contiguous() if self.last else torch.empty(shape, dtype=dtype, device=self.device)
        )
        dist.broadcast(buffer, src=self.last_rank, group=self.pp_group)
        return buffer

    @torch.inference_mode()
    def token_losses(
        self,
        tokens: torch.Tensor,
        labels: torch.Tensor,
        position_ids: Optional[torch.Tensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """[b, s] float32 negative log-likelihood of each label given its prefix."""
        if position_ids is None:
            position_ids = _positions(tokens)
        out = self._run(tokens, position_ids, attention_mask, labels)
        if out is not None:
            out = out.float()
        return self._from_last_stage(out, tuple(tokens.shape), torch.float32)

    @torch.inference_mode()
    def target_scores(
        self, tokens: torch.Tensor, labels: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """([b, s] float32 log-probability of each label, [b, s] whether it is the arg-max); the
        normaliser covers the padded output as the training loss does, the arg-max the tokenizer's
        ids only, and only [b, s] maxima and sums cross the TP ranks."""
        labels = labels.to(self.device)
        out = self._run(tokens, _positions(tokens), None, None)
        if out is not None:
            logits = out.float()  # [b, s, V/tp]
            shard = logits.size(-1)
            first = self.tp_rank * shard
            ids = torch.arange(first, first + shard, device=logits.device)
            real_max = logits.masked_fill(ids >= self.vocab_size, float("-inf")).amax(-1)
            top = logits.amax(-1)
            local = (labels >= first) & (labels < first + shard)
            index = (labels - first).clamp(0, shard - 1).unsqueeze(-1)
            target = torch.where(local, logits.gather(-1, index).squeeze(-1), 0.0)
            if self.tp > 1:
                for value, op in ((real_max, dist.ReduceOp.MAX), (top, dist.ReduceOp.MAX)):
                    dist.all_reduce(value, op=op, group=self.tp_group)
            sum_exp = torch.exp(logits - top.unsqueeze(-1)).sum(-1)
            if self.tp > 1:
                dist.all_reduce(sum_exp, group=self.tp_group)
                dist.all_reduce(target, group=self.tp_group)
            log_prob = target - top - torch.log(sum_exp)
            greedy = (target >= real_max).float()
            out = torch.stack([log_prob, greedy])
        out = self._from_last_stage(out, (2, *tokens.shape), torch.float32)
        return out[0], out[1] > 0


def _positions(tokens: torch.Tensor) -> torch.Tensor:
    return torch.arange(tokens.size(1), device=tokens.device).unsqueeze(0).expand_as(tokens)


@dataclass
class LoadedModel:
    """A checkpoint ready to score: the run, its tokenizer and a scorer at this layout."""

    run: object
    tokenizer: object
    scorer: ModelScorer
    seq_length: int

    @property
    def name(self) -> str:
        """The run's root directory, which names the model in results."""
        return self.run.root


def load_for_evaluation(
    load_dir: str,
    pg: "ProcessGroups",
    *,
    iteration: Optional[int] = None,
    tokenizer_model: Optional[str] = None,
) -> LoadedModel:
    """Load a checkpoint (any arm, saved at any layout) at the TP x PP layout of `pg` (from
    `megatron_ext.inference.loading.init_inference_parallel`), LEV with its eval table."""
    # deferred: keeps megatron.core (slow) out of this module's import
    from megatron_ext.inference.loading import (
        find_checkpoint,
        load_model,
        run_model_config,
        run_tokenizer,
    )

    run = find_checkpoint(load_dir, iteration)
    tokenizer = run_tokenizer(run, tokenizer_model)
    config = run_model_config(
        run, tensor_model_parallel_size=pg.tp_size, pipeline_model_parallel_size=pg.pp_size
    )
    if config.embedding.embedding_type == "lev":
        lev = dataclasses.replace(config.embedding.lev, eval_table=True)
        config = config.replace(embedding=dataclasses.replace(config.embedding, lev=lev))
    model = load_model(run, config, pg)
    scorer = ModelScorer(model, config.hidden_size, tokenizer.vocab_size, pg)
    return LoadedModel(run, tokenizer, scorer, config.seq_length)


@contextlib.contextmanager
def _pinned_lev_tables(model: torch.nn.Module) -> Iterator[None]:
    """Check each LEV eval table once for the whole pass instead of at every batch (the exact
    comparison of the parameters with the table's snapshot): the weights do not change while
    batches are scored."""
    # deferred: keeps megatron.core (slow) out of this module's import
    from megatron_ext.lev.layer import LEVEmbedding

    with contextlib.ExitStack() as stack:
        for module in model.modules():
            if isinstance(module, LEVEmbedding):
                stack.enter_context(module.pinned_eval_table())
        yield


def score_batches(
    scorer: ModelScorer,
    batches: Iterable[Batch],
    consumers: Iterable[TokenConsumer],
    *,
    total_targets: Optional[int] = None,
    desc: str = "evaluating",
    show_progress: bool = True,
) -> dict:
    """Score every batch and hand its (targets, losses) to the consumers (a progress bar on
    rank 0); {"targets", "seconds", "tokens_per_second"}."""
    consumers = list(consumers)
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    bar = tqdm(
        total=total_targets,
        desc=desc,
        unit="tok",
        unit_scale=True,
        disable=not (show_progress and rank0),
        mininterval=1.0,
        dynamic_ncols=True,
    )
    start = time.perf_counter()
    scored = 0
    with bar, _pinned_lev_tables(scorer.model):
        for batch in batches:
            losses = scorer.token_losses(
                batch.tokens, batch.labels, batch.position_ids, batch.attention_mask
            )
            mask = batch.loss_mask.to(losses.device) > 0
            targets = batch.labels.to(losses.device)[mask].cpu().numpy().astype(np.int64)
            values = losses[mask].cpu().numpy().astype(np.float64)
            for consumer in consumers:
                consumer.update(targets, values)
            scored += len(targets)
            bar.update(len(targets))
    seconds = time.perf_counter() - start
    rate = scored / seconds if seconds > 0 else float("nan")
    if rank0:
        logger.info("%s: %d tokens in %.1f s (%.0f tokens/s)", desc, scored, seconds, rate)
    return {"targets": scored, "seconds": seconds, "tokens_per_second": rate}
