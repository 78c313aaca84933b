"""Per-token losses and log-probabilities of a loaded checkpoint, at any TP x PP layout.

Every rank of the tool's world (TP x PP ranks, no data parallelism) sees the same batch and
returns the same tensor: under TP the vocab-parallel cross entropy gives the per-token loss
without gathering logits; under PP the stages pass [s, b, h] activations forward and the last
stage broadcasts the result. No autograd; LEV looks ids up in its eval table.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from dataclasses import dataclass
from typing import Iterable, Iterator, Optional, Protocol, Sequence

import numpy as np
import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from megatron_ext.inference.generation import lev_eval_tables
from megatron_ext.inference.loading import (
    find_checkpoint,
    load_model,
    run_model_config,
    run_tokenizer,
)
from megatron_ext.parallel import ProcessGroups

logger = logging.getLogger(__name__)

__all__ = [
    "Batch",
    "LoadedModel",
    "ModelScorer",
    "TokenConsumer",
    "batch_of_rows",
    "load_for_evaluation",
    "micro_batches",
    "rank0",
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


def batch_of_rows(rows: Sequence[tuple[np.ndarray, np.ndarray, int]], width: int) -> Batch:
    """A `Batch` [len(rows), width] of (inputs, labels, first scored position) rows, padded and
    masked; position ids count from 0 in every row, as in training."""
    tokens = np.zeros((len(rows), width), dtype=np.int64)
    labels = np.zeros_like(tokens)
    mask = np.zeros((len(rows), width), dtype=np.float32)
    for i, (inputs, targets, first) in enumerate(rows):
        tokens[i, : len(inputs)] = inputs
        labels[i, : len(targets)] = targets
        mask[i, first : len(targets)] = 1.0
    t = torch.from_numpy(tokens)
    return Batch(
        tokens=t,
        labels=torch.from_numpy(labels),
        loss_mask=torch.from_numpy(mask),
        position_ids=torch.arange(width).unsqueeze(0).expand_as(t).contiguous(),
    )


def micro_batches(rows: Iterable, width: int, micro_batch_size: int) -> Iterator[Batch]:
    """`batch_of_rows` of every `micro_batch_size` rows (the last one may hold fewer)."""
    rows = iter(rows)
    while chunk := list(itertools.islice(rows, micro_batch_size)):
        yield batch_of_rows(chunk, width)


class TokenConsumer(Protocol):
    """Receives the scored targets of each batch (e.g. a perplexity sum, frequency bins)."""

    def update(self, targets: np.ndarray, losses: np.ndarray) -> None:
        """targets: [n] int64 ids; losses: [n] float64 negative log-likelihoods (nats)."""


class ModelScorer:
    """Runs this rank's stage of the eval-mode `model` forward-only and returns what the last
    stage computed: PP activations [s, b, `hidden_size`] over `pg.pp`, vocab-parallel logits
    over `pg.tp`; ids at or above `vocab_size` (padding) are never predicted."""

    def __init__(
        self, model: torch.nn.Module, hidden_size: int, vocab_size: int, pg: ProcessGroups
    ) -> None:
        self.model = model
        self.hidden_size = hidden_size
        self.vocab_size = vocab_size
        self.pg = pg
        self.device = next(model.parameters()).device
        self.pp = pg.pp_size
        self.last = pg.is_last_stage

    def _run(self, tokens, position_ids, attention_mask, labels) -> Optional[torch.Tensor]:
        tokens = tokens.to(self.device)
        position_ids = position_ids.to(self.device)
        if attention_mask is not None:
            attention_mask = attention_mask.to(self.device)
        if labels is not None:
            labels = labels.to(self.device)
        if self.pp > 1:
            hidden = None
            if not self.pg.is_first_stage:
                b, s = tokens.shape
                hidden = torch.empty(s, b, self.hidden_size, device=self.device)
                dist.recv(hidden, src=self.pg.pp_neighbour(-1))
            self.model.set_input_tensor(hidden)
        out = self.model(tokens, position_ids, attention_mask, labels=labels if self.last else None)
        if self.pp > 1 and not self.last:
            dist.send(out.float().contiguous(), dst=self.pg.pp_neighbour(1))
            return None
        return out

    def _from_last_stage(self, out: Optional[torch.Tensor], shape, dtype) -> torch.Tensor:
        if self.pp == 1:
            return out
        buffer = (
            out.contiguous() if self.last else torch.empty(shape, dtype=dtype, device=self.device)
        )
        last_rank = dist.get_process_group_ranks(self.pg.pp)[-1]
        dist.broadcast(buffer, src=last_rank, group=self.pg.pp)
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
            first = self.pg.tp_rank * shard
            ids = torch.arange(first, first + shard, device=logits.device)
            real_max = logits.masked_fill(ids >= self.vocab_size, float("-inf")).amax(-1)
            top = logits.amax(-1)
            local = (labels >= first) & (labels < first + shard)
            index = (labels - first).clamp(0, shard - 1).unsqueeze(-1)
            target = torch.where(local, logits.gather(-1, index).squeeze(-1), 0.0)
            if self.pg.tp_size > 1:
                for value in (real_max, top):
                    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self.pg.tp)
            sum_exp = torch.exp(logits - top.unsqueeze(-1)).sum(-1)
            if self.pg.tp_size > 1:
                dist.all_reduce(sum_exp, group=self.pg.tp)
                dist.all_reduce(target, group=self.pg.tp)
            log_prob = target - top - torch.log(sum_exp)
            greedy = (target >= real_max).float()
            out = torch.stack([log_prob, greedy])
        out = self._from_last_stage(out, (2, *tokens.shape), torch.float32)
        return out[0], out[1] > 0


def rank0() -> bool:
    """Whether this process prints and writes the results (global rank 0, or no world)."""
    return not dist.is_initialized() or dist.get_rank() == 0


def _positions(tokens: torch.Tensor) -> torch.Tensor:
    return torch.arange(tokens.size(1), device=tokens.device).unsqueeze(0).expand_as(tokens)


@dataclass
class LoadedModel:
    """A checkpoint ready to score: the run, its tokenizer and a scorer at this layout."""

    run: object
    tokenizer: object
    scorer: ModelScorer
    seq_length: int


def load_for_evaluation(
    load_dir: str,
    pg: ProcessGroups,
    *,
    iteration: Optional[int] = None,
    tokenizer_model: Optional[str] = None,
) -> LoadedModel:
    """Load a checkpoint (any arm, saved at any layout) at the TP x PP layout of `pg` (from
    `megatron_ext.inference.loading.init_inference_parallel`), LEV with its eval table."""
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
    bar = tqdm(
        total=total_targets,
        desc=desc,
        unit="tok",
        unit_scale=True,
        disable=not (show_progress and rank0()),
        mininterval=1.0,
        dynamic_ncols=True,
    )
    start = time.perf_counter()
    scored = 0
    with bar, lev_eval_tables(scorer.model):
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
    if rank0():
        logger.info("%s: %d tokens in %.1f s (%.0f tokens/s)", desc, scored, seconds, rate)
    return {"targets": scored, "seconds": seconds, "tokens_per_second": rate}
