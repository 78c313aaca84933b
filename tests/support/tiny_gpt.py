"""A tiny GPT and random-token samples for tests that drive `training.pretrain` directly
(no tokenizer, no files): the pieces Megatron-LM's `pretrain_gpt.py` supplies, at toy size."""

from __future__ import annotations

import torch

from megatron_ext.config.layout import ParallelConfig, PrecisionConfig
from megatron_ext.config.model import ModelConfig
from megatron_ext.models import build_model
from megatron_ext.parallel import ProcessGroups
from megatron_ext.training.initialization import initialize_like_single_stage

__all__ = [
    "SEQ",
    "VOCAB",
    "RandomSamples",
    "forward_step",
    "model_config",
    "model_provider",
    "pipeline_chunks",
]

SEQ, VOCAB = 16, 128


class RandomSamples(torch.utils.data.Dataset):
    """Deterministic random token sequences (sample i from seed i) in the GPT dataset's
    format: `tokens`/`labels`/`loss_mask`/`position_ids`, each [SEQ]."""

    def __init__(self, count: int) -> None:
        self.count = count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> dict:
        tokens = torch.randint(0, VOCAB, (SEQ + 1,), generator=torch.Generator().manual_seed(index))
        return dict(
            tokens=tokens[:-1],
            labels=tokens[1:],
            loss_mask=torch.ones(SEQ),
            position_ids=torch.arange(SEQ),
        )


def forward_step(data_iterator, model):
    """Megatron's forward-step contract: (per-token losses, loss_func -> (mean loss, report))."""
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])

    def loss_func(losses):
        total = losses.float().sum()
        count = batch["loss_mask"].sum()
        return total / count, {"lm loss": torch.stack([total.detach(), count])}

    return output, loss_func


def model_config(
    embedding_type: str = "untied", num_layers: int = 2, hidden_size: int = 32
) -> ModelConfig:
    """The tiny GPT (`embedding_type` arm), SEQ tokens a sample: its run's `RunConfig.model`."""
    return ModelConfig(
        vocab_size=VOCAB,
        num_layers=num_layers,
        hidden_size=hidden_size,
        num_attention_heads=4,
        seq_length=SEQ,
        embedding=dict(embedding_type=embedding_type),
    )


def model_provider(
    pre_process: bool, post_process: bool, pg_collection=None, *, embedding_type: str = "untied"
):
    """A 2-layer, hidden-32 GPT stage (`embedding_type` arm) on the groups of `pg_collection`."""
    return build_model(
        model_config(embedding_type),
        parallel=ParallelConfig(),  # the TransformerConfig's layout; the groups are pg's
        precision=PrecisionConfig(),
        pre_process=pre_process,
        post_process=post_process,
        pg=ProcessGroups.from_collection(pg_collection),
    )


def pipeline_chunks(
    pg,
    *,
    num_layers: int,
    hidden_size: int,
    chunks_per_rank: int,
    seed: int,
    embedding_type: str = "untied",
):
    """This pipeline rank's `chunks_per_rank` model chunks (virtual stages) of a GPT with the
    `embedding_type` arm, each holding exactly the weights of the same layers of one
    single-stage model built from `seed`, so that any pipeline layout trains like one rank."""
    config = model_config(embedding_type, num_layers, hidden_size)
    parallel = ParallelConfig(pipeline_model_parallel_size=pg.pp_size)
    v = chunks_per_rank
    chunks = [
        build_model(
            config,
            parallel=parallel,
            precision=PrecisionConfig(),
            pre_process=pg.is_first_stage and c == 0,
            post_process=pg.is_last_stage and c == v - 1,
            pg=pg,
            vp_stage=c if v > 1 else None,
            vp_size=v if v > 1 else None,
        )
        for c in range(v)
    ]
    one_stage = dict(parallel=ParallelConfig(), precision=PrecisionConfig())
    with torch.no_grad():
        for chunk in chunks:
            initialize_like_single_stage(chunk, lambda: build_model(config, **one_stage), seed)
    return chunks
