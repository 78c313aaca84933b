"""GPU check of the Transformer Engine spec: local and TE weights give the same logits.

`tools/gpu_check.py` runs it; the name mapping it relies on is `te_mapping`'s.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_ext.config.layout import ParallelConfig, PrecisionConfig
from megatron_ext.config.model import ModelConfig
from megatron_ext.models import build_model
from megatron_ext.models.full_state_dict import gather_full_state_dict, load_full_state_dict
from megatron_ext.parallel import ProcessGroups, destroy_parallel, initialize_parallel

__all__ = ["compare_te_and_local_logits"]


def compare_te_and_local_logits(seed: int = 0) -> dict:
    """GPU check: a small LEV model's local weights, copied into the TE spec through the
    checkpoint names, give the same logits under BF16 autocast (single process)."""
    pg = ProcessGroups.current()
    started = pg is None
    if started:
        pg = initialize_parallel(backend="nccl")  # a one-rank world outside torchrun
    try:
        cfg = ModelConfig(
            vocab_size=4096,
            num_layers=2,
            hidden_size=512,
            num_attention_heads=8,
            seq_length=256,
            embedding=dict(embedding_type="lev", lev=dict(num_heads=4, rank=32)),
        )
        torch.manual_seed(seed)
        one_rank = dict(parallel=ParallelConfig(), precision=PrecisionConfig(), pg=pg)
        local = build_model(cfg, **one_rank).cuda()
        te = build_model(cfg.replace(transformer_impl="transformer_engine"), **one_rank).cuda()
        names = {n for n, _ in te.named_parameters()}
        load_full_state_dict(te, gather_full_state_dict(local, pg.tp), pg.tp)
        ids = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length), device="cuda")
        pos = torch.arange(cfg.seq_length, device="cuda").expand(2, -1)
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            a = local(ids, pos, None).float()
            b = te(ids, pos, None).float()
        rel = ((a - b).abs().max() / a.abs().max()).item()
        fused = sorted(n for n in names if "layer_norm_weight" in n)
        return dict(
            status="pass" if rel < 2e-2 else "fail",
            max_relative_logit_difference=rel,
            tolerance=2e-2,
            te_fused_norm_parameters=len(fused),
        )
    finally:
        if started:
            destroy_parallel()
            if dist.is_initialized():
                dist.destroy_process_group()
