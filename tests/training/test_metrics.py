"""FLOPs per iteration and the Megatron-style log line (training.metrics)."""

from __future__ import annotations

from megatron_ext.training.metrics import flops_per_iteration, format_train_line


def test_flops_match_six_n_d_for_short_sequences():
    """Without the attention term, training FLOPs are 6 x (GEMM parameters) x tokens."""
    from megatron_ext.config.model import ModelConfig

    h, ffn, v, layers, gbs, s = 256, 512, 1000, 3, 4, 1
    config = ModelConfig(
        vocab_size=v,
        seq_length=s,
        num_layers=layers,
        hidden_size=h,
        ffn_hidden_size=ffn,
        num_attention_heads=8,
        num_query_groups=8,
        embedding=dict(embedding_type="tied"),
    )
    flops = flops_per_iteration(config, gbs)
    gemm_params = layers * (4 * h * h + 3 * h * ffn) + h * v
    attention = 3 * layers * 4 * s * h * gbs * s
    assert flops == 6 * gemm_params * gbs * s + attention


def test_iteration_flops_and_gpu_check_share_one_formula():
    """The iteration line's MFU and tools/gpu_check.py's MFU count the same FLOPs, LEV's
    generator included."""
    from megatron_ext.config.model import ModelConfig
    from megatron_ext.models.memory import flops_per_token

    config = ModelConfig(vocab_size=512, seq_length=64, num_layers=2, hidden_size=64)
    assert config.embedding.embedding_type == "lev"
    tied = config.replace(embedding=dict(embedding_type="tied"))
    assert flops_per_iteration(config, 8) == flops_per_token(config) * 8 * 64
    assert flops_per_iteration(config, 8) > flops_per_iteration(tied, 8)


def test_log_line_has_megatron_fields():
    line = format_train_line(
        dict(
            iteration=10,
            train_iters=100,
            consumed_samples=80,
            iteration_ms=12.5,
            tflops=1.5,
            mfu=0.4,
            tokens_per_sec=2048.0,
            lr=3e-4,
            global_batch_size=8,
            loss=5.5,
            loss_scale=None,
            grad_norm=0.9,
            skipped=0,
            nonfinite=0,
        )
    )
    for text in (
        "iteration       10/     100",
        "consumed samples:           80",
        "elapsed time per iteration (ms): 12.5",
        "throughput per GPU (TFLOP/s/GPU): 1.5",
        "MFU: 40.0%",
        "learning rate: 3.000000E-04",
        "lm loss: 5.500000E+00",
        "grad norm: 0.900",
    ):
        assert text in line


def test_timers_levels():
    import time

    from megatron_ext.training.metrics_logger import Timers

    off, level1, level2 = Timers(0), Timers(1), Timers(2)
    for timers in (off, level1, level2):
        timers.mark()
        with timers.span("inner"):
            time.sleep(0.01)
        timers.mark("outer")
        timers.add("added", 0.5)
    assert off.take() == {}
    assert list(level1.take()) == ["outer"]  # level 1: marks only
    totals = level2.take()
    assert list(totals) == ["outer", "inner", "added"]  # marks first, then spans
    assert 0.01 <= totals["inner"] <= totals["outer"]  # a span does not restart the mark clock
    assert totals["added"] == 0.5
    assert level2.take() == {}  # cleared
