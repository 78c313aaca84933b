#!/usr/bin/env python
"""Pretrain Leviathan models and the paper's baselines with Megatron-LM's flags.

    torchrun --nproc-per-node 8 pretrain_leviathan.py \\
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --sequence-parallel \\
        --model-size 400m --embedding-type lev --seq-length 512 \\
        --micro-batch-size 8 --global-batch-size 512 --train-iters 20000 \\
        --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-fraction 0.01 \\
        --bf16 --data-path data/pile_text_document --tokenizer-type TikTokenizer \\
        --tokenizer-model o200k_base.tiktoken --save ckpt --load ckpt --save-interval 1000

Like Megatron-LM's pretrain_gpt.py this file only supplies the model provider, the forward
step and the datasets provider; `megatron_ext.training.pretrain` runs the loop.
Exit codes: 0 trained (or left cleanly on --exit-* / SIGTERM), 1 non-finite loss or grad norm,
2 bad flags or data, a damaged or unsafe --load checkpoint, or a --save another run holds,
130 Ctrl-C (one line says which checkpoint was kept and which iterations were lost).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import sys
from typing import Optional, Sequence

import torch

from megatron_ext.cli import run_tool, setup_logging

logger = logging.getLogger("pretrain_leviathan")


def model_provider(
    model_config,
    parallel,
    precision,
    pre_process: bool = True,
    post_process: bool = True,
    pg_collection=None,
    vp_stage=None,
    vp_size=None,
):
    """This pipeline stage of the model (or model chunk `vp_stage` of `vp_size`), built at the
    run's `parallel` layout and `precision`, communicating over `pg_collection` (None:
    megatron's global groups, as for the single-stage twin built before PP training)."""
    from megatron_ext.models import build_model
    from megatron_ext.parallel import ProcessGroups

    pg = None if pg_collection is None else ProcessGroups.from_collection(pg_collection)
    return build_model(
        model_config,
        parallel=parallel,
        precision=precision,
        pre_process=pre_process,
        post_process=post_process,
        pg=pg,
        vp_stage=vp_stage,
        vp_size=vp_size,
    )


def get_batch(data_iterator, use_attention_mask: bool = False) -> dict:
    """The next micro-batch on this rank's device, cut to this context-parallel rank's share
    (megatron's load-balanced split: of 2 x CP chunks, CP rank r keeps r and 2 x CP - 1 - r);
    the attention mask stays whole."""
    import megatron_ext.megatron_import  # noqa: F401

    from megatron.core.utils import get_batch_on_this_cp_rank

    batch = next(data_iterator)
    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    keys = ("tokens", "labels", "loss_mask", "position_ids")
    out = get_batch_on_this_cp_rank({k: batch[k].to(device, non_blocking=True) for k in keys})
    mask = batch.get("attention_mask") if use_attention_mask else None
    out["attention_mask"] = mask.to(device) if mask is not None else None
    return out


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor, per_token: bool = False):
    """(the loss to backpropagate, {"lm loss": [sum, count]} to report): the mean next-token
    loss over the unmasked tokens of the micro-batch (with `per_token`,
    --calculate-per-token-loss, their sum: the loop divides by the global token count). Under
    context parallelism the token count is summed across CP and the loss multiplied by the CP
    size, since gradients are averaged over DP x CP."""
    import megatron_ext.megatron_import  # noqa: F401

    from megatron.core import parallel_state

    losses = output_tensor.float().view(-1)
    mask = loss_mask.float().view(-1)
    total = torch.sum(losses * mask)
    count = mask.sum()
    stats = torch.stack([total.detach(), count])
    if per_token:
        return total, {"lm loss": stats}
    cp = parallel_state.get_context_parallel_world_size()
    if cp > 1:
        summed = stats.clone()  # the report stays this rank's own [sum, count]
        torch.distributed.all_reduce(summed, group=parallel_state.get_context_parallel_group())
        return total * cp / summed[1].clamp(min=1.0), {"lm loss": stats}
    return total / count.clamp(min=1.0), {"lm loss": stats}


def forward_step(
    data_iterator, model, use_attention_mask: bool = False, per_token_loss: bool = False
):
    """Megatron's forward-step contract: (output tensor, loss function of it)."""
    batch = get_batch(data_iterator, use_attention_mask)
    output = model(
        batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"]
    )
    return output, functools.partial(loss_func, batch["loss_mask"], per_token=per_token_loss)


def _error(message: str) -> None:
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"error: {message}", file=sys.stderr, flush=True)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Parse flags, build the configs and train; return the process exit code (0, 1 or 2)."""
    setup_logging(stream=sys.stdout, rank_prefix=True, quiet_megatron=False)
    # The package (and megatron-core, which warns about Apex / Transformer Engine when it is
    # imported) is imported only now, after the warning filter of setup_logging; the providers
    # above import it lazily for the same reason.
    from megatron_ext.checkpoint.format import CheckpointError
    from megatron_ext.config.arguments import parse_config
    from megatron_ext.data.loading import build_train_valid_test_datasets
    from megatron_ext.data.readers import DataError
    from megatron_ext.data.tokenizers import TokenizerError, build_tokenizer
    from megatron_ext.training import CollectiveTimeoutError, NonFiniteError, pretrain
    from megatron_ext.training.interrupt import TrainingInterrupted

    try:
        # Parsed once into the frozen RunConfig: all that `pretrain` and the providers receive.
        run = parse_config(argv)
        data = run.data
        if data.tokenizer_type is None:
            raise ValueError(
                "--tokenizer-type is required (e.g. SentencePieceTokenizer with "
                "--tokenizer-model, or NullTokenizer with --vocab-size)"
            )
        tokenizer = build_tokenizer(
            data.tokenizer_type,
            data.tokenizer_model,
            vocab_size=data.vocab_size,
            tiktoken_pattern=data.tiktoken_pattern,
            vocab_file=data.vocab_file,
            merge_file=data.merge_file,
        )
        run = run.with_tokenizer(tokenizer)  # the model's padded vocabulary; its fingerprint
    except (ValueError, DataError, TokenizerError) as error:
        _error(str(error))
        return 2
    stage = functools.partial(model_provider, run.model, run.parallel, run.precision)
    # The whole model as one stage (PP > 1 copies its initial weights: `initialization.py`).
    one_stage = dataclasses.replace(
        run.parallel,
        pipeline_model_parallel_size=1,
        num_layers_per_virtual_pipeline_stage=None,
        virtual_pipeline_model_parallel_size=None,
    )
    try:
        reason = pretrain(
            run,
            model_provider=stage,
            forward_step=functools.partial(
                forward_step,
                use_attention_mask=data.reset_attention_mask,
                per_token_loss=run.engine.calculate_per_token_loss,
            ),
            datasets_provider=functools.partial(
                build_train_valid_test_datasets,
                run.data,
                tokenizer,
                seq_length=run.model.seq_length,
                seed=run.seed,
            ),
            full_model_provider=functools.partial(
                model_provider, run.model, one_stage, run.precision
            ),
        )
    except TrainingInterrupted as interrupted:  # Ctrl-C: what was kept, what was lost
        if int(os.environ.get("RANK", "0")) == 0:
            print(str(interrupted), file=sys.stderr, flush=True)
        return 130
    except NonFiniteError as error:
        _error(str(error))
        return 1
    except CollectiveTimeoutError as error:  # every rank says which of its groups timed out
        print(f"error: {error}", file=sys.stderr, flush=True)
        return 1
    except (DataError, TokenizerError, CheckpointError) as error:
        _error(str(error))
        return 2
    logger.info("done (%s)", reason)
    return 0


def cli_main(argv: Optional[Sequence[str]] = None) -> int:
    """The command (``python pretrain_leviathan.py``, ``python -m pretrain_leviathan``, the
    ``leviathan-pretrain`` console script): :func:`main` under megatron_ext.cli.run_tool."""
    return run_tool(main, argv, log_format=None, shutdown_distributed=False)


if __name__ == "__main__":
    sys.exit(cli_main())
