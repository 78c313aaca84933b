"""torchrun entry of test_megatron_engine.py: `pretrain` from a config built in code, with
the portable engine or the megatron-core engine on the recording CPU doubles.

    python -m torch.distributed.run --nproc-per-node 2 _engine_entry.py OUT RUN [RUN ...]

Each RUN is NAME=ENGINE or NAME=ENGINE@FROM, run in turn in the same processes (so that one
launch's start-up serves several runs; `pretrain` sets up and tears down the process groups of
each): ENGINE is portable or megatron; OUT/NAME receives log.jsonl, ckpt/, each rank's log
lines (log<rank>.txt) and (megatron) calls<rank>.json; FROM names an earlier RUN whose
checkpoint (OUT/FROM/ckpt) it resumes from (iteration 2).
"""

import json
import logging
import os
import re
import sys
from pathlib import Path

from tests.support.tiny_gpt import RandomSamples, forward_step, model_config, model_provider


def main(engine: str, out: Path, load: str | None) -> None:
    from megatron_ext.config.run import (
        BatchConfig,
        CheckpointConfig,
        EngineConfig,
        EvalConfig,
        LoggingConfig,
        OptimizerConfig,
        RunConfig,
    )
    from megatron_ext.training import pretrain

    cfg = RunConfig(
        batch=BatchConfig(
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
            decoupled_lr=3e-3,
        ),
        model=model_config(),
        eval=EvalConfig(eval_interval=4, eval_iters=1),
        ckpt=CheckpointConfig(
            save=str(out / "ckpt"), save_interval=2, load=load, ckpt_step=2 if load else None
        ),
        log=LoggingConfig(
            log_interval=1,
            log_jsonl=str(out / "log.jsonl"),
            loss_curve=False,
            log_params_norm=True,
            log_num_zeros_in_grad=True,
        ),
        engine=EngineConfig(ddp_impl=engine),
    )

    def builder(cfg, model, forward_step, pg, phase, timers):
        from megatron_ext.training.engine_portable import PortableEngine

        built = PortableEngine(cfg, model, forward_step, pg, phase, timers)
        # The data-parallel machinery around the portable engine's stage (torch DDP).
        (out / f"dp{os.environ['RANK']}.txt").write_text(
            ",".join(type(m).__name__ for m in built.ddp)
        )
        return built

    if engine == "megatron":
        from megatron_ext.training.megatron_engine import MegatronEngine
        from tests.support.megatron_doubles import CallLog, recording_parts

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
            datasets_provider=lambda counts: tuple(RandomSamples(n) for n in counts),
            engine_builder=builder,
        )
    finally:
        if engine == "megatron":
            rank = os.environ["RANK"]
            calls = [[name, {k: repr(v) for k, v in d.items()}] for name, d in log.calls]
            (out / f"calls{rank}.json").write_text(json.dumps(calls))
    assert reason == "finished", reason


def run(out: Path, spec: str) -> None:
    """One RUN (see the module docstring), its log lines also written to OUT/NAME/log<rank>.txt."""
    match = re.fullmatch(r"(\w+)=(portable|megatron)(?:@(\w+))?", spec)
    if match is None:
        raise SystemExit(f"bad RUN {spec!r}: expected NAME=ENGINE or NAME=ENGINE@FROM")
    name, engine, source = match.groups()
    (out / name).mkdir(exist_ok=True)
    handler = logging.FileHandler(out / name / f"log{os.environ['RANK']}.txt")
    handler.setFormatter(logging.Formatter("%(message)s"))
    logging.getLogger().addHandler(handler)
    try:
        main(engine, out / name, str(out / source / "ckpt") if source else None)
    finally:
        logging.getLogger().removeHandler(handler)
        handler.close()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for spec in sys.argv[2:]:
        run(Path(sys.argv[1]), spec)
