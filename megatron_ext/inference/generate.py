"""Generate text from a training checkpoint (any arm) with a KV cache.

    python tools/generate.py --load ckpt/lev --prompt "The river" --max-new-tokens 64
    python tools/generate.py --load ckpt/lev --prompts-file prompts.txt --temperature 0.8 \\
        --top-p 0.9 --seed 1 --output completions.jsonl

A prompts file holds one prompt per line (.txt) or {"prompt": ...} objects (.jsonl). Greedy by
default; stops at end-of-document unless --no-stop-at-eod.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from dataclasses import replace
from typing import Optional, Sequence

from megatron_ext._paths import atomic_write
from megatron_ext.cli import run_tool
from megatron_ext.config.flags import ArgumentError, ArgumentParser, add_flags
from megatron_ext.config.layout import ParallelConfig
from megatron_ext.data.tokenizers import TokenizerError

logger = logging.getLogger("generate")


def add_checkpoint_flags(p) -> None:
    """--ckpt-step and --tokenizer-model: which checkpoint of a run, and where its tokenizer is
    (of every tool that loads a training checkpoint)."""
    p.add_argument(
        "--ckpt-step",
        "--iteration",
        dest="ckpt_step",
        type=int,
        default=None,
        help="iteration to load (default: latest)",
    )
    p.add_argument(
        "--tokenizer-model",
        default=None,
        help="the run's tokenizer, if not where it recorded it (for GPT2BPETokenizer: the "
        "directory holding its vocab and merge files)",
    )


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--load", required=True, help="a run's --save directory or an iter_XXXXXXX")
    add_checkpoint_flags(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    src.add_argument("--prompts-file", help="one prompt per line (.txt) or jsonl with 'prompt'")
    p.add_argument(
        "--max-new-tokens", type=int, default=64, help="most tokens generated per prompt"
    )
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-k", type=int, default=0, help="0: no cut")
    p.add_argument("--top-p", type=float, default=1.0, help="1.0: no cut")
    p.add_argument(
        "--seed",
        type=int,
        default=None,
        help="sampling seed (default: none, a fresh draw each run)",
    )
    p.add_argument("--no-stop-at-eod", action="store_true", help="ignore the end-of-document id")
    p.add_argument("--batch-size", type=int, default=8, help="prompts per batch")
    p.add_argument("--no-cache", action="store_true", help="recompute the prefix every step")
    p.add_argument(
        "--decode-step",
        choices=("auto", "lean", "megatron"),
        default="auto",
        help="lean: plain torch ops on the model's weights (TP=1 local spec, KV cache); "
        "megatron: the model's forward; auto: lean where it covers the model (logged)",
    )
    p.add_argument("--output", default=None, help="write jsonl here instead of printing")
    add_flags(p, ParallelConfig, "tensor_model_parallel_size", help="the layout to generate at")
    return p


def read_prompts(args: argparse.Namespace) -> list[str]:
    if args.prompt:
        return list(args.prompt)
    path = args.prompts_file
    if not os.path.isfile(path):
        raise ArgumentError(f"--prompts-file {path} does not exist")
    prompts = []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            line = line.rstrip("\n")
            if not line.strip():
                continue
            if path.endswith(".jsonl"):
                try:
                    prompts.append(json.loads(line)["prompt"])
                except (ValueError, KeyError, TypeError):
                    raise ArgumentError(
                        f"{path}:{number} is not a JSON object with a 'prompt' string"
                    ) from None
            else:
                prompts.append(line)
    if not prompts:
        raise ArgumentError(f"--prompts-file {path} holds no prompt")
    return prompts


def completion_text(tokenizer, prompt_ids: list[int], new: list[int]) -> str:
    """The text the new ids add to the prompt (decoded in context, so a leading space stays)."""
    prefix = tokenizer.detokenize(prompt_ids)
    full = tokenizer.detokenize(prompt_ids + new)
    return full[len(prefix) :] if full.startswith(prefix) else tokenizer.detokenize(new)


def run(args: argparse.Namespace) -> list[dict]:
    """One record per prompt of the flags' checkpoint and prompts."""
    # deferred: keeps torch and megatron.core (slow) out of this module's import
    from megatron_ext.inference import generation, loading

    sampling = _sampling_config(args, generation.SamplingConfig)
    prompts = read_prompts(args)
    saved = loading.find_checkpoint(args.load, args.ckpt_step)
    tokenizer = loading.run_tokenizer(saved, args.tokenizer_model)
    if not args.no_stop_at_eod:
        sampling = replace(sampling, stop_token_ids=(tokenizer.eod,))
    tp = args.tensor_model_parallel_size
    try:
        config = loading.run_model_config(saved, tensor_model_parallel_size=tp)
    except ValueError as error:
        raise ArgumentError(str(error)) from None
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != tp:
        raise ArgumentError(
            f"--tensor-model-parallel-size {tp} needs {tp} ranks, not {world}: launch "
            f"torchrun --nproc-per-node {tp}"
        )
    pg = loading.init_inference_parallel(tp, 1)
    model = loading.load_model(saved, config, pg)
    step, why = generation.decode_step_for(model, sampling.use_cache)
    if args.decode_step != "auto":
        if args.decode_step == "lean" and step != "lean":
            raise ArgumentError(f"--decode-step lean: {why}; use --decode-step megatron")
        step, why = args.decode_step, "--decode-step"
    rank0 = int(os.environ.get("RANK", "0")) == 0
    if rank0:
        logger.info("decode step: %s (%s)", step, why)
    start = time.perf_counter()
    records = []
    for first in range(0, len(prompts), args.batch_size):
        batch = prompts[first : first + args.batch_size]
        ids = [tokenizer.tokenize(p) for p in batch]
        empty = [p for p, i in zip(batch, ids) if not i]
        if empty:
            raise ArgumentError(f"prompt {empty[0]!r} encodes to no token")
        outputs = generation.generate(
            model, ids, sampling, tp_group=pg.tp, vocab_size=tokenizer.vocab_size, step=step
        )
        for prompt, prompt_ids, new in zip(batch, ids, outputs):
            records.append(
                {
                    "prompt": prompt,
                    "completion": completion_text(tokenizer, prompt_ids, new),
                    "prompt_ids": prompt_ids,
                    "completion_ids": new,
                    "stop_reason": "eod" if len(new) < sampling.max_new_tokens else "length",
                }
            )
    produced = sum(len(r["completion_ids"]) for r in records)
    elapsed = time.perf_counter() - start
    if rank0:
        logger.info(
            "generated %d tokens for %d prompts in %.1f s (%.1f tokens/s)",
            produced,
            len(prompts),
            elapsed,
            produced / max(elapsed, 1e-9),
        )
    return records


def _sampling_config(args: argparse.Namespace, config_class):
    """The `SamplingConfig` of the flags, checked with the batch and decode-step flags."""
    try:
        sampling = config_class(
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            seed=args.seed,
            use_cache=not args.no_cache,
        )
    except ValueError as error:
        raise ArgumentError(str(error)) from None
    if args.batch_size < 1:
        raise ArgumentError("--batch-size must be >= 1")
    if args.decode_step == "lean" and args.no_cache:
        raise ArgumentError("--decode-step lean always uses its KV cache; drop --no-cache")
    return sampling


def _errors() -> tuple:
    # deferred: keeps torch (slow) out of this module's import
    from megatron_ext.checkpoint.format import CheckpointError

    return (ArgumentError, CheckpointError, TokenizerError)


def _main(argv: Optional[Sequence[str]]) -> int:
    args = build_parser().parse_args(argv)
    records = run(args)
    if int(os.environ.get("RANK", "0")) != 0:
        return 0
    if args.output:
        atomic_write(args.output, "".join(json.dumps(r) + "\n" for r in records))
        logger.info("wrote %d completions to %s", len(records), args.output)
    else:
        for record in records:
            print(f"### {record['prompt']}\n{record['prompt']}{record['completion']}\n", flush=True)
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    return run_tool(_main, argv, errors=_errors)


if __name__ == "__main__":
    sys.exit(main())
