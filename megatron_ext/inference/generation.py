"""Autoregressive text generation with a KV cache (megatron-core's `StaticInferenceContext`),
for any arm at any TP.

Prompts of different lengths share one batch as megatron's static engine does it (the shortest
prompt prefilled, then one token per row, its own prompt token while it has one), so every row
computes what it would alone. Under TP the token chosen on TP rank 0 is broadcast.
`step="lean"` computes the same logits with the CPU accelerations' `LeanDecoder`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import megatron_ext.megatron_import  # noqa: F401

import torch
import torch.distributed as dist
from megatron.core.inference.contexts import StaticInferenceContext

from megatron_ext import cpu_accel
from megatron_ext.lev.layer import LEVEmbedding
from megatron_ext.tensor_parallel import model_tp_size_rank

__all__ = [
    "DECODE_STEPS",
    "SamplingConfig",
    "decode_step_for",
    "generate",
    "lev_eval_tables",
    "next_token_logits",
    "sample",
]

logger = logging.getLogger(__name__)

DECODE_STEPS = ("megatron", "lean")
"""How `generate` computes each step's logits (see its `step` argument)."""


@dataclass(frozen=True)
class SamplingConfig:
    """How to pick each new token: temperature 0 is greedy; otherwise logits / temperature, cut
    to the `top_k` most likely (0: no cut) and to the smallest set reaching `top_p` (1.0: no cut),
    sampled with `seed` (None: torch's generator). A row stops after `max_new_tokens` or at a
    `stop_token_ids` id (not returned)."""

    max_new_tokens: int
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: Optional[int] = None
    stop_token_ids: tuple[int, ...] = ()
    use_cache: bool = True
    """False recomputes the whole prefix at every step (the benchmark's baseline)."""

    def __post_init__(self) -> None:
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0: greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0: no cut), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        """True when temperature is 0: `sample` then takes the argmax."""
        return self.temperature == 0.0


def sample(
    logits: torch.Tensor, cfg: SamplingConfig, generator: Optional[torch.Generator] = None
) -> torch.Tensor:
    """Pick one id per row of `logits` [b, V] (float32) -> [b] int64."""
    if cfg.greedy:
        return logits.argmax(dim=-1)
    logits = logits / cfg.temperature
    if cfg.top_k:
        k = min(cfg.top_k, logits.size(-1))
        kth = torch.topk(logits, k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if cfg.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # Drop an id when the ids strictly more likely already reach top_p (the first is kept).
        drop_sorted = probs.cumsum(dim=-1) - probs >= cfg.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@contextlib.contextmanager
def lev_eval_tables(model: torch.nn.Module) -> Iterator[None]:
    """Let every LEV embedding of `model` answer eval forwards from its materialised table,
    built (or checked) once on entry: the weights must not change inside the block."""
    changed = []
    with contextlib.ExitStack() as stack:
        for module in model.modules():
            if isinstance(module, LEVEmbedding):
                if not module.lev_config.eval_table:
                    changed.append((module, module.lev_config))
                    module.lev_config = dataclasses.replace(module.lev_config, eval_table=True)
                stack.enter_context(module.pinned_eval_table())
        try:
            yield
        finally:
            for module, config in changed:
                module.lev_config = config


def next_token_logits(
    model: torch.nn.Module, tokens: torch.Tensor, inference_context=None
) -> torch.Tensor:
    """Logits [b, V] (TP-gathered, padding included; float32 or wider) for the token after
    `tokens` [b, s]; with `inference_context`, `tokens` follow its cached prefix, which they extend.
    """
    logits = model(
        tokens, None, None, inference_context=inference_context, runtime_gather_output=True
    )  # [b, s' (1 with a context), V]
    if inference_context is not None:
        inference_context.sequence_len_offset += tokens.size(1)
    logits = logits[:, -1, :]
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


def decode_step_for(model: torch.nn.Module, use_cache: bool = True) -> tuple[str, str]:
    """(step, why): "lean" where `LeanDecoder` covers `model` (same logits, less Python per
    token), else "megatron" and what stands in the way, for the caller's log line."""
    if not use_cache:
        return "megatron", "no KV cache requested"
    lean = cpu_accel.decode_step()
    if lean is None:
        return "megatron", cpu_accel.OFF
    reason = lean.lean_decode_unsupported(_unwrap(model))
    if reason is not None:
        return "megatron", f"the lean step does not cover {reason}"
    return "lean", "local spec at TP=1: plain torch ops on the model's weights"


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    while hasattr(model, "module") and not hasattr(model, "decoder"):
        model = model.module
    return model


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    cfg: SamplingConfig,
    *,
    tp_group: Optional[dist.ProcessGroup] = None,
    vocab_size: Optional[int] = None,
    step: str = "megatron",
) -> list[list[int]]:
    """Continue every prompt (token ids, at least one each); returns the new ids of each
    (without the stop token).

    `model` is an eval-mode `LeviathanModel` (or GPTModel) holding the whole pipeline; under
    TP>1 every rank of `tp_group` passes the same prompts and the token chosen on its first rank
    is broadcast (None: no TP, refused for a TP>1 model). Ids at or above `vocab_size` (the
    padding) are never produced. `step` "megatron" runs the model's forward (with megatron's
    `StaticInferenceContext` unless `cfg.use_cache` is False); "lean" the CPU accelerations'
    `LeanDecoder` (TP=1 local spec, cache only; a model it does not cover is refused).
    """
    inner = _check_request(model, prompts, cfg, step)
    if cfg.max_new_tokens == 0:
        return [[] for _ in prompts]
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    tokens, lengths = _prompt_tokens(inner, prompts, cfg.max_new_tokens, device)
    (batch, total), shortest = tokens.shape, int(lengths.min())
    generator = None
    if not cfg.greedy:
        seed = cfg.seed if cfg.seed is not None else int(torch.randint(2**62, ()).item())
        generator = torch.Generator(device=device).manual_seed(seed)
    tp_size, _ = model_tp_size_rank(inner, tp_group)
    stops = torch.tensor(cfg.stop_token_ids or [-1], device=device)

    context = None
    if cfg.use_cache and step == "megatron":
        context = StaticInferenceContext(batch, total)
    # Row r's new tokens are tokens[r, lengths[r]:end[r]]; a stop token moves its end.
    end = torch.clamp(lengths + cfg.max_new_tokens, max=total)
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    fed = 0
    try:
        with lev_eval_tables(model):
            lean = (
                cpu_accel.decode_step().LeanDecoder(inner, batch, total) if step == "lean" else None
            )
            for position in range(shortest, total):
                if lean is not None:
                    logits = lean(tokens[:, fed:position])
                elif context is not None:
                    logits = next_token_logits(model, tokens[:, fed:position], context)
                else:
                    logits = next_token_logits(model, tokens[:, :position])
                fed = position
                if vocab_size is not None and vocab_size < logits.size(-1):
                    logits[:, vocab_size:] = float("-inf")
                chosen = sample(logits, cfg, generator)
                if tp_size > 1:
                    dist.broadcast(chosen, dist.get_global_rank(tp_group, 0), group=tp_group)
                in_prompt = position < lengths
                tokens[:, position] = torch.where(in_prompt, tokens[:, position], chosen)
                if cfg.stop_token_ids:
                    stopped = ~in_prompt & ~done & torch.isin(chosen, stops)
                    end = torch.where(stopped, position, end)
                    done |= stopped | (position + 1 >= end)
                    # The one host sync per step, only where a stop token can end rows early.
                    if bool(done.all()):
                        break
    finally:
        model.train(was_training)
    return [tokens[row, len(p) : int(end[row])].tolist() for row, p in enumerate(prompts)]


def _check_request(model, prompts, cfg: SamplingConfig, step: str) -> torch.nn.Module:
    """The unwrapped model, once the step, the model's stages and the prompts can generate."""
    if step not in DECODE_STEPS:
        raise ValueError(f"step must be one of {DECODE_STEPS}, got {step!r}")
    if step == "lean" and not cfg.use_cache:
        raise ValueError("the lean decode step always uses its KV cache (use_cache=True)")
    if step == "lean" and cpu_accel.decode_step() is None:
        raise ValueError(
            f"the lean decode step is one of the CPU accelerations, and {cpu_accel.OFF}"
        )
    inner = _unwrap(model)
    if not (getattr(inner, "pre_process", True) and getattr(inner, "post_process", True)):
        raise ValueError(
            "generation needs the whole model on one pipeline stage; load the checkpoint with "
            "--pipeline-model-parallel-size 1 (any saved layout loads)"
        )
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    return inner


def _prompt_tokens(
    inner, prompts, max_new_tokens: int, device
) -> tuple[torch.Tensor, torch.Tensor]:
    """([batch, longest prompt + max_new_tokens] ids, the prompts at their start; the prompt
    lengths), with a warning when that runs past the model's trained sequence length."""
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    total = int(lengths.max()) + max_new_tokens
    seq_length = getattr(getattr(inner, "config", None), "seq_length", None) or getattr(
        inner, "max_sequence_length", None
    )
    if seq_length is not None and total > seq_length:
        logger.warning(
            "generating up to %d positions, beyond the %d the model was trained on",
            total,
            seq_length,
        )
    tokens = torch.zeros(len(prompts), total, dtype=torch.long, device=device)
    for row, prompt in enumerate(prompts):
        tokens[row, : len(prompt)] = torch.as_tensor(list(prompt), dtype=torch.long)
    return tokens, lengths
