"""The compiled CPU cross-entropy kernel (megatron_ext.cpu_accel.cross_entropy) and its shared build
module (megatron_ext.cpu_accel.build): losses against a float64 log-sum-exp, the exp's accuracy in
ulp against float64, thread-count independence, bad targets, and the logged fallback of
`chunked_head_cross_entropy` when the kernel is unavailable."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from megatron_ext import tensor_parallel as tp
from megatron_ext.cpu_accel import build, cross_entropy

if cross_entropy.kernel_error() is not None:  # pragma: no cover - needs no g++
    pytest.skip(f"kernel unavailable: {cross_entropy.kernel_error()}", allow_module_level=True)

INF, NAN = float("inf"), float("nan")


def _float64_losses(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """log(sum exp(x)) - x[target] in float64, written out (not torch's cross entropy)."""
    x = logits.double()
    m = x.max(dim=-1, keepdim=True).values
    lse = (x - m).exp().sum(-1).log() + m.squeeze(-1)
    return lse - x.gather(-1, target.unsqueeze(-1)).squeeze(-1)


def _rows(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    rows = [torch.randn(vocab, generator=g) * scale for scale in (0.1, 1, 5, 80)]
    rows.append((torch.rand(vocab, generator=g) * 2 - 1) * 1e4)  # a +-1e4 spread
    rows.append(torch.rand(vocab, generator=g) * 160 - 80)  # uniform in [-80, 80]
    huge = torch.randn(vocab, generator=g)
    huge[3 % vocab] = 1e4  # one value dominates
    rows.append(huge)
    neg = torch.randn(vocab, generator=g)
    neg[::5] = -INF  # -inf entries (not at the targets below)
    rows.append(neg)
    rows.append(torch.full((vocab,), -3.5))  # all equal
    logits = torch.stack(rows)
    target = torch.randint(0, vocab, (len(rows),), generator=g)
    target[6] = 3 % vocab  # the dominant value
    target[7] = 1 % vocab  # a finite entry of the -inf row (all -inf when vocab is 1)
    return logits, target


@pytest.mark.parametrize("vocab", [1, 7, 16, 100, 1023, 32000])
def test_losses_match_float64_log_sum_exp(vocab):
    logits, target = _rows(vocab)
    got = cross_entropy.cross_entropy(logits, target)
    want = _float64_losses(logits, target)
    assert got.dtype == torch.float32 and got.shape == target.shape
    torch.testing.assert_close(got.double(), want, rtol=2e-6, atol=2e-6, equal_nan=vocab == 1)


def test_non_finite_rows_follow_torch():
    logits = torch.tensor(
        [
            [0.0, NAN, 1.0, 2.0],  # NaN anywhere: NaN
            [-INF, -INF, -INF, -INF],  # all -inf: NaN
            [0.0, INF, 1.0, 2.0],  # +inf: NaN
            [1.0, -INF, 2.0, 3.0],  # the target is -inf: +inf
            [1.0, -INF, 2.0, 3.0],  # -inf elsewhere: finite
        ]
    )
    target = torch.tensor([0, 0, 0, 1, 2])
    got = cross_entropy.cross_entropy(logits, target)
    want = torch.nn.functional.cross_entropy(logits, target, reduction="none")
    torch.testing.assert_close(got, want, equal_nan=True)
    assert torch.isnan(got[:3]).all() and got[3] == INF and torch.isfinite(got[4])


def test_exp_is_within_one_ulp_of_float64_over_minus_104_to_0():
    x = torch.linspace(-104, 0, 1_000_001, dtype=torch.float32)
    x = torch.cat([x, -torch.logspace(-30, 0, 1001, dtype=torch.float32)])
    got = cross_entropy.exp(x).double()
    exact = torch.exp(x.double())
    ulp = torch.from_numpy(np.spacing(exact.float().abs().numpy())).double()
    normal = exact >= torch.finfo(torch.float32).tiny
    err = (got - exact).abs() / ulp
    assert err[normal].max() < 1.0  # normal results: under 1 ulp of the exact value
    # subnormal results: within one subnormal spacing (2^-149) of the exact value
    assert ((got - exact).abs()[~normal] <= 2.0**-149).all()
    special = torch.tensor([-INF, NAN, INF, -103.0, -104.0, 0.0, -0.0])
    out = cross_entropy.exp(special)
    assert out[0] == 0 and torch.isnan(out[1]) and out[2] == INF
    assert (
        out[3] == 2.0**-149 and out[4] == 0
    )  # exp(-104) is below half of 2^-149 and out[5] == 1 and out[6] == 1


def test_threads_give_bit_identical_losses():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(64, 5000, generator=g) * 7
    target = torch.randint(0, 5000, (64,), generator=g)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cross_entropy.cross_entropy(logits, target)
        torch.set_num_threads(2)
        two = cross_entropy.cross_entropy(logits, target)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_strided_rows_and_out():
    g = torch.Generator().manual_seed(2)
    wide = torch.randn(6, 50, generator=g)
    logits = wide[:, 5:45]  # row stride 50, 40 columns
    target = torch.randint(0, 40, (6,), generator=g)
    out = torch.empty(6)
    got = cross_entropy.cross_entropy(logits, target, out=out)
    assert got is out
    torch.testing.assert_close(got.double(), _float64_losses(logits, target), rtol=2e-6, atol=0)


@pytest.mark.parametrize("bad", [-1, 40])
def test_out_of_range_targets_are_one_clear_error(bad):
    target = torch.tensor([0, bad])
    with pytest.raises(IndexError, match=f"target id {bad} is out of range .* 40"):
        cross_entropy.cross_entropy(torch.randn(2, 40), target)
    with torch.no_grad(), pytest.raises(IndexError, match=f"target id {bad} is out of range"):
        tp.chunked_head_cross_entropy(torch.randn(2, 1, 4), torch.randn(40, 4), target.view(2, 1))


def test_unavailable_kernel_falls_back_with_one_logged_reason(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("MEGATRON_EXT_CACHE", str(tmp_path / "cache"))
    for cached in (cross_entropy.load_library, cross_entropy.kernel_error):
        cached.cache_clear()
    tp._chunk_kernel_error.cache_clear()
    try:
        error = cross_entropy.kernel_error()
        assert error is not None and "no-such-compiler" in error and "$CXX" in error
        torch.manual_seed(0)
        hidden, weight = torch.randn(8, 2, 16), torch.randn(30, 16)
        target = torch.randint(0, 30, (8, 2))
        with caplog.at_level(logging.WARNING, logger=tp.__name__), torch.no_grad():
            first = tp.chunked_head_cross_entropy(hidden, weight, target, rows=5)
            tp.chunked_head_cross_entropy(hidden, weight, target, rows=5)
        reasons = [r.getMessage() for r in caplog.records if "no-such-compiler" in r.getMessage()]
        assert len(reasons) == 1 and "vocab_parallel_cross_entropy" in reasons[0]
        logits = torch.nn.functional.linear(hidden, weight)
        torch.testing.assert_close(first, tp.vocab_parallel_cross_entropy(logits, target, None))
    finally:
        for cached in (cross_entropy.load_library, cross_entropy.kernel_error):
            cached.cache_clear()
        tp._chunk_kernel_error.cache_clear()


def test_autocast_bf16_logits_take_the_torch_loss_with_one_debug_reason(caplog):
    # Under bf16 autocast (a --bf16 run's evaluation) float32 hidden states and weights give
    # bf16 logits: the chunks use vocab_parallel_cross_entropy. The run chose bf16, nothing is
    # to be done about it: the reason is logged once at DEBUG, never as a warning (issue 56).
    tp._chunk_kernel_error.cache_clear()
    try:
        torch.manual_seed(0)
        hidden, weight = torch.randn(8, 2, 16), torch.randn(30, 16)
        target = torch.randint(0, 30, (8, 2))
        with caplog.at_level(logging.DEBUG, logger=tp.__name__), torch.no_grad():
            with torch.autocast("cpu", dtype=torch.bfloat16):
                got = tp.chunked_head_cross_entropy(hidden, weight, target, rows=5)
                tp.chunked_head_cross_entropy(hidden, weight, target, rows=5)
                logits = torch.nn.functional.linear(hidden, weight)
            assert logits.dtype == torch.bfloat16
            want = tp.vocab_parallel_cross_entropy(logits, target, None)
        reasons = [r for r in caplog.records if "torch.bfloat16" in r.getMessage()]
        assert len(reasons) == 1 and "vocab_parallel_cross_entropy" in reasons[0].getMessage()
        assert reasons[0].levelno == logging.DEBUG
        torch.testing.assert_close(got, want.float())
        # Without autocast the same inputs take the kernel: float32 losses of float32 logits.
        with torch.no_grad():
            plain = tp.chunked_head_cross_entropy(hidden, weight, target, rows=5)
        want64 = _float64_losses(torch.nn.functional.linear(hidden, weight), target)
        torch.testing.assert_close(plain, want64.float())
    finally:
        tp._chunk_kernel_error.cache_clear()


def test_build_error_names_the_kernel_and_the_hint(monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with pytest.raises(build.CpuKernelUnavailable, match="the demo kernel.*do this"):
        build.build_library(tmp_path / "x.cpp", "demo kernel", "do this")
    bad = tmp_path / "bad.cpp"
    bad.write_text("this is not C++\n")
    monkeypatch.delenv("CXX")
    monkeypatch.setenv("MEGATRON_EXT_CACHE", str(tmp_path / "cache"))
    with pytest.raises(build.CpuKernelUnavailable, match="building the demo kernel .*do this"):
        build.build_library(bad, "demo kernel", "do this")
    assert not list((tmp_path / "cache").iterdir())  # no temporary left behind
