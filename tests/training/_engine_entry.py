"""torchrun entry of test_megatron_engine.py: `pretrain` from a config built in code, with
the portable engine or the megatron-core engine on the recording CPU doubles.

    python -m torch.distributed.run --nproc-per-node 2 _engine_entry.py ENGINE OUT [LOAD]

ENGINE is portable or megatron; OUT receives log.jsonl, ckpt/ and (megatron) calls<rank>.json;
LOAD is a checkpoint root to resume from (iteration 2).
"""

import json
import os
import sys
from pathlib import Path

import torch

SEQ, VOCAB = 16, 128


class Samples(torch.utils.data.Dataset):
    """Deterministic random token sequences in the GPT dataset's sample format."""

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
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])

    def loss_func(losses):
        total = losses.float().sum()
        count = batch["loss_mask"].sum()
        return total / count, {"lm loss": torch.stack([total.detach(), count])}

    return output, loss_func


def model_provider(pre_process: bool, post_process: bool, pg_collection=None):
    from megatron_ext.models import ModelConfig, build_model
    from megatron_ext.parallel import ProcessGroups

    config = ModelConfig(
        vocab_size=VOCAB,
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        seq_length=SEQ,
        embedding=dict(embedding_type="untied"),
    )
    return build_model(
        config,
        pre_process=pre_process,
        post_process=post_process,
        pg=ProcessGroups.from_collection(pg_collection),
    )


def main(engine: str, out: Path, load: str | None) -> None:
    from megatron_ext.training import pretrain
    from megatron_ext.training.config import (
        BatchConfig,
        CheckpointConfig,
        EngineConfig,
        EvalConfig,
        LoggingConfig,
        OptimizerConfig,
        TrainingConfig,
    )
    from megatron_ext.training.megatron_features import FeatureConfig

    cfg = TrainingConfig(
        batch=BatchConfig(
            seq_length=SEQ,
            micro_batch_size=2,
            global_batch_size=8,
            train_iters=4,
            rampup_batch_size=[4, 4, 8],  # 4, then 8 after 8 samples
        ),
        optim=OptimizerConfig(
            lr=1e-3,
            lr_decay_steps=40,
            start_weight_decay=0.1,
            end_weight_decay=0.1,
            clip_grad=1.0,
        ),
        eval=EvalConfig(eval_interval=4, eval_iters=1),
        ckpt=CheckpointConfig(
            save=str(out / "ckpt"), save_interval=2, load=load, ckpt_step=2 if load else None
        ),
        log=LoggingConfig(log_interval=1, log_jsonl=str(out / "log.jsonl"), loss_curve=False),
        features=FeatureConfig(
            decoupled_lr=3e-3,
            log_params_norm=True,
            log_num_zeros_in_grad=True,
        ),
        engine=EngineConfig(ddp_impl=engine),
    )

    def builder(cfg, model, forward_step, pg, phase, timers):
        from megatron_ext.training.engine_portable import PortableEngine

        built = PortableEngine(cfg, model, forward_step, pg, phase, timers)
        # Which data-parallel machinery the portable engine chose (torch DDP at PP=1).
        (out / f"dp{os.environ['RANK']}.txt").write_text(type(built.ddp).__name__)
        return built

    if engine == "megatron":
        from megatron_ext.testing.megatron_doubles import CallLog, recording_parts
        from megatron_ext.training.megatron_engine import MegatronEngine

        log = CallLog()

        def builder(cfg, model, forward_step, pg, phase, timers):
            return MegatronEngine(
                cfg, model, forward_step, pg, phase, timers, parts=recording_parts(log)
            )

    try:
        reason = pretrain(
            cfg,
            model_provider=model_provider,
            forward_step=forward_step,
            datasets_provider=lambda counts: tuple(Samples(n) for n in counts),
            engine_builder=builder,
        )
    finally:
        if engine == "megatron":
            rank = os.environ["RANK"]
            calls = [[name, {k: repr(v) for k, v in d.items()}] for name, d in log.calls]
            (out / f"calls{rank}.json").write_text(json.dumps(calls))
    assert reason == "finished", reason


if __name__ == "__main__":
    import logging

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    main(sys.argv[1], Path(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else None)
