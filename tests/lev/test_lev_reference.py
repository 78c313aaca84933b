"""Every LEV kernel (`--lev-kernel reference|torch|cpu|triton`, each that can run here) equals
an independent float64 reference written with plain loops from docs/lev.md section 2.

The module-level tests run `LEVEmbedding` against `reference_lev` below; the kernel-level tests
run `lev.kernels.lev_modes` on each backend against the same function in float64 (values, all
five input gradients, gradcheck, the product at the extremes of its range, autocast, what is
saved for backward, 1 vs 2 threads). Triton runs in its CPU interpreter (tests/conftest.py sets
TRITON_INTERPRET=1 when there is no GPU), so its shapes stay small.

The reference below shares no code with megatron_ext.lev: digits by integer arithmetic, the
basis knot by knot from the definition of beta2, the separable product exactly as docs/lev.md
writes it (sign * exp(sum log(|phi| + 1e-9))), one token, head, coordinate and mode at a time.
Its gradients come from autograd through those loops.
"""

import dataclasses
import os

import pytest
import torch

from megatron_ext.config.lev import LEVConfig
from megatron_ext.lev import math as lev_math
from megatron_ext.lev.kernels import LEVKernelOptions, lev_modes
from tests.support.memory import saved_tensor_bytes

# Triton's kernels in its CPU interpreter (no GPU: tests/conftest.py) run each launch in Python,
# seconds a case, and are the same whichever way the CPU accelerations are switched: marked slow,
# they run in the full suite's main pass, not in `--fast` nor in the accelerations-off pass.
TRITON = pytest.param(
    "triton", marks=[pytest.mark.slow] if os.environ.get("TRITON_INTERPRET") == "1" else []
)
KERNELS = ["reference", "torch", "cpu", TRITON]
FUSED = ["torch", "cpu", TRITON]


def _device(kernel: str) -> torch.device:
    """Where `kernel`'s tensors go; skips the test when the kernel cannot run here."""
    if kernel == "cpu":
        from megatron_ext.lev.kernels import cpu_kernel_error

        if cpu_kernel_error() is not None:  # no g++, or the CPU accelerations are off
            pytest.skip(f"CPU kernel unavailable: {cpu_kernel_error()}")
    if kernel == "triton":
        pytest.importorskip("triton", reason="triton is not installed (pip install '.[gpu]')")
        from megatron_ext.lev import triton_kernel

        if triton_kernel.INTERPRETED:
            return torch.device("cpu")
        if not torch.cuda.is_available():
            pytest.skip("triton was imported before TRITON_INTERPRET=1 was set")
        return torch.device("cuda")
    return torch.device("cpu")


def _digits_of(i, base, num_digits):
    return [(i // base ** (num_digits - 1 - m)) % base for m in range(num_digits)]


def _beta2(x):
    if x < 0.5:
        return 0.75 - x * x
    if x < 1.5:
        return 0.5 * (1.5 - x) ** 2
    return x * 0.0


def reference_lev(ids, params, cfg):
    """[len(ids), D] embeddings of python int ids from TP=1 float64 parameters."""
    k, b, d = cfg.num_digits, cfg.base, cfg.seed_dim
    h, kappa, r = cfg.num_heads, cfg.num_knots, cfg.rank
    C, W = params["codebooks"], params["seed_proj"]
    gain, bias = params["seed_norm_weight"], params["seed_norm_bias"]
    delta, W_out = params["spline_delta"], params["out_proj"]
    rows = []
    for i in ids:
        digits = _digits_of(i, b, k)
        if cfg.codebook_combine == "sum":  # step 2
            z = C[0, digits[0]]
            for m in range(1, k):
                z = z + C[m, digits[m]]
        else:
            z = torch.cat([C[m, digits[m]] for m in range(k)])
        e = torch.zeros(W_out.shape[-1], dtype=torch.float64)
        for layer in range(h):
            u = [sum(W[layer, o, j] * z[j] for j in range(z.shape[0])) for o in range(d)]  # 3a
            mean = sum(u) / d
            var = sum((uo - mean) ** 2 for uo in u) / d
            t = []
            for o in range(d):  # 3b
                normed = (u[o] - mean) / torch.sqrt(var + cfg.norm_eps)
                t.append(
                    torch.sigmoid((normed * gain[layer, o] + bias[layer, o]) / cfg.temperature)
                )
            basis = []
            for o in range(d):  # 3c
                B = [_beta2((kappa - 1) * abs(t[o] - j / (kappa - 1))) for j in range(kappa)]
                if cfg.normalize_basis:
                    total = sum(B)
                    B = [v / total for v in B]
                basis.append(B)
            for rho in range(r):  # 3d-e
                log_sum, negatives = 0.0, 0
                for o in range(d):
                    phi = sum(basis[o][j] * (1.0 + delta[layer, o, j, rho]) for j in range(kappa))
                    log_sum = log_sum + torch.log(torch.abs(phi) + cfg.product_eps)
                    negatives += int(phi.item() < 0)
                e = e + (-1.0) ** negatives * torch.exp(log_sum) * W_out[layer, rho]  # 4
        rows.append(e)
    return torch.stack(rows)


IDS = [[0, 7, 49, 7, 23, 11], [11, 49, 48, 1, 7, 30]]  # repeats (dedup) and both ends of [0, V)

CONFIGS = {
    "sum": dict(),
    "concat": dict(codebook_combine="concat"),
    "unnormalised": dict(normalize_basis=False, temperature=0.7),
    "k2_kappa3": dict(num_digits=2, num_knots=3, rank=2),
}


def _reference_and_grads(module, ids, weight):
    params = {
        n: p.detach().double().clone().requires_grad_(True) for n, p in module.named_parameters()
    }
    flat = [i for row in ids for i in row]
    out = reference_lev(flat, params, module.lev_config).view(len(ids), len(ids[0]), -1)
    (out * weight).sum().backward()
    return out.detach(), {n: p.grad for n, p in params.items()}


def _module_and_grads(module, ids, weight):
    module.zero_grad(set_to_none=True)
    out = module(torch.tensor(ids))
    (out * weight.to(out.dtype)).sum().backward()
    return out.detach(), {n: p.grad for n, p in module.named_parameters()}


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_matches_reference_float64(lev, name, kernel):
    _device(kernel)
    cfg = lev.tiny_config(**CONFIGS[name])
    module = lev.make_lev(cfg, dtype=torch.float64, spread=1.5)
    weight = torch.randn(2, 6, cfg.hidden_size, dtype=torch.float64)
    ref_out, ref_grads = _reference_and_grads(module, IDS, weight)
    assert (ref_out.abs() > 1e-3).any()
    for dedup in (True, False):
        module.lev_config = dataclasses.replace(cfg, kernel=kernel, dedup=dedup)
        out, grads = _module_and_grads(module, IDS, weight)
        where = f"kernel={kernel} dedup={dedup}"
        torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-10, msg=where)
        for n, g in grads.items():
            torch.testing.assert_close(g, ref_grads[n], rtol=1e-10, atol=1e-10, msg=f"{n} {where}")


def test_reference_sees_negative_spline_values(lev):
    # spread=1.5 must actually produce negative factors, or the sign tests above prove nothing.
    from megatron_ext.lev import math as lev_math

    cfg = lev.tiny_config()
    module = lev.make_lev(cfg, dtype=torch.float64, spread=1.5)
    z = lev_math.seed(module.codebooks, lev_math.to_digits(torch.arange(50), cfg.base, 3))
    t = lev_math.seed_to_t(z, module.seed_proj, module.seed_norm_weight, module.seed_norm_bias, 2.0)
    phi = lev_math.spline_values(lev_math.bspline_basis(t, cfg.num_knots), module.spline_delta)
    negatives = (phi < 0).sum(dim=2)
    assert (negatives % 2 == 1).any() and (negatives >= 2).any()


@pytest.mark.parametrize("kernel", KERNELS)
def test_matches_reference_float32(lev, kernel):
    _device(kernel)
    cfg = lev.tiny_config(chunk_size=4, kernel=kernel)  # several chunks in the torch kernel
    module = lev.make_lev(cfg, dtype=torch.float32, spread=0.3)
    weight = torch.randn(2, 6, cfg.hidden_size, dtype=torch.float64)
    ref_out, ref_grads = _reference_and_grads(module, IDS, weight)
    out, grads = _module_and_grads(module, IDS, weight)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref_out, rtol=1e-4, atol=1e-4)
    for n, g in grads.items():
        torch.testing.assert_close(g.double(), ref_grads[n], rtol=1e-4, atol=1e-4, msg=n)


@pytest.mark.parametrize("kernel", KERNELS)
def test_bf16_autocast_keeps_float32_product(lev, kernel):
    _device(kernel)
    cfg = lev.tiny_config(kernel=kernel)
    module = lev.make_lev(cfg, dtype=torch.float32, spread=0.3)
    ids = torch.tensor(IDS)
    exact = module(ids)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = module(ids)
    # LEV runs outside autocast and returns its parameters' dtype, as a lookup table does
    # (training/precision.py): the output under autocast is the float32 output itself.
    assert low.dtype == torch.float32
    assert torch.equal(low, exact)
    low.sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in module.parameters())


# ----------------------------------------------------------------------------- kernel level

# Low enough that t = sigmoid(LN(.) / tau) spreads over [0, 1] and reaches both end knots.
_TEMPERATURE = 0.3


def _opts(
    normalize: bool = True, eps: float = 1e-9, chunk_size: int = 0, combine: str = "sum"
) -> LEVKernelOptions:
    return LEVKernelOptions(
        temperature=_TEMPERATURE, normalize_basis=normalize, product_eps=eps,
        chunk_size=chunk_size, codebook_combine=combine,
    )  # fmt: skip


def _inputs(dtype, n=37, d_in=5, h=3, d=9, kappa=6, r=5, seed=0, delta_std=0.8, device="cpu"):
    gen = torch.Generator().manual_seed(seed)

    def draw(*shape, std=1.0, mean=0.0):
        x = mean + std * torch.randn(*shape, generator=gen, dtype=torch.float64)
        return x.to(device=device, dtype=dtype).requires_grad_()

    # delta_std 0.8: many spline values are negative (the product's sign matters).
    return [
        draw(n, d_in),
        draw(h, d, d_in, std=0.5),
        draw(h, d, mean=1.0, std=0.3),
        draw(h, d, std=0.3),
        draw(h, d, kappa, r, std=delta_std),
    ]


def _definition(inputs, opts: LEVKernelOptions):
    """docs/lev.md steps 3a-3e in float64, spelled out here (not through lev.math)."""
    z, w, gain, bias, delta = (x.double() for x in inputs)
    kappa = delta.shape[2]
    u = torch.einsum("nj,hoj->hno", z, w)
    mean = u.mean(-1, keepdim=True)
    var = (u - mean).pow(2).mean(-1, keepdim=True)
    normed = (u - mean) / torch.sqrt(var + opts.norm_eps) * gain[:, None] + bias[:, None]
    t = torch.sigmoid(normed / opts.temperature)  # [h, n, d]
    dist = ((kappa - 1) * (t[..., None] - torch.arange(kappa, dtype=t.dtype) / (kappa - 1))).abs()
    basis = torch.where(
        dist < 0.5, 0.75 - dist**2, torch.where(dist < 1.5, 0.5 * (1.5 - dist) ** 2, 0 * dist)
    )
    if opts.normalize_basis:
        basis = basis / basis.sum(-1, keepdim=True)
    phi = torch.einsum("hndk,hdkr->hndr", basis, 1 + delta)
    negatives = (phi < 0).sum(2)
    magnitude = torch.exp(torch.log(phi.abs() + opts.product_eps).sum(2))
    return ((1 - 2 * (negatives % 2)) * magnitude).transpose(0, 1)  # [n, h, r]


def _with_grads(fn, inputs, weight):
    for x in inputs:
        x.grad = None
    out = fn()
    (out * weight.to(out.dtype)).sum().backward()
    return out.detach(), [x.grad.clone() for x in inputs]


_GRAD_NAMES = ["z", "seed_proj", "norm_weight", "norm_bias", "spline_delta"]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("normalize", [True, False])
def test_kernel_equals_the_definition_in_float64(kernel, normalize):
    device = _device(kernel)
    inputs = _inputs(torch.float64, device=device)
    opts = _opts(normalize, chunk_size=8)  # several chunks in the torch kernel
    weight = torch.randn(37, 3, 5, dtype=torch.float64)
    ref, ref_grads = _with_grads(lambda: _definition(inputs, opts), inputs, weight)
    out, grads = _with_grads(lambda: lev_modes(*inputs, opts, kernel=kernel), inputs, weight)
    assert (ref < 0).any() and (ref > 0).any()  # both signs of the product were produced
    t = lev_math.seed_to_t(inputs[0].detach(), *(x.detach() for x in inputs[1:4]), _TEMPERATURE)
    assert (t * 5 < 0.5).any() and (t * 5 > 4.5).any()  # both end knots are dropped somewhere
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-14)
    for name, g, g_ref in zip(_GRAD_NAMES, grads, ref_grads):
        torch.testing.assert_close(g, g_ref, rtol=1e-11, atol=1e-13, msg=name)


@pytest.mark.parametrize("kernel", KERNELS)
def test_kernel_float32_matches_the_definition(kernel):
    device = _device(kernel)
    inputs64 = _inputs(torch.float64, n=60, d=32, r=16, kappa=16, delta_std=0.1, device=device)
    inputs32 = [x.detach().float().requires_grad_() for x in inputs64]
    opts = _opts()
    weight = torch.randn(60, 3, 16, dtype=torch.float64)
    ref, ref_grads = _with_grads(lambda: _definition(inputs64, opts), inputs64, weight)
    out, grads = _with_grads(lambda: lev_modes(*inputs32, opts, kernel=kernel), inputs32, weight)
    assert out.dtype == torch.float32
    # float32 rounding of a product of 32 factors (and of their sums): relative to the scale.
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
    for name, g, g_ref in zip(_GRAD_NAMES, grads, ref_grads):
        tol = 1e-5 * float(g_ref.abs().max())
        torch.testing.assert_close(g.double(), g_ref, rtol=1e-4, atol=tol, msg=name)


def _gradcheck_inputs(device) -> list[torch.Tensor]:
    """Small float64 inputs (4 seeds, d=3, h=2, r=2, kappa=4) whose full Jacobian is cheap."""
    inputs = _inputs(torch.float64, d=3, h=2, r=2, kappa=4, device=device)
    inputs = [
        x.detach()[:4].clone() if i == 0 else x.detach().clone() for i, x in enumerate(inputs)
    ]
    return [x.requires_grad_() for x in inputs]


# Triton's interpreter runs a kernel launch per finite difference (over half a minute for
# gradcheck); its backward is checked by test_full_jacobian_equals_the_definitions instead, which
# covers the same Jacobian entries against the definition's, at a far tighter tolerance.
@pytest.mark.parametrize("kernel", ["reference", "torch", "cpu"])
def test_gradcheck(kernel):
    inputs = _gradcheck_inputs(_device(kernel))
    for normalize in (True, False):
        opts = _opts(normalize, chunk_size=2)
        assert torch.autograd.gradcheck(lambda *a: lev_modes(*a, opts, kernel=kernel), inputs)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("normalize", [True, False])
def test_full_jacobian_equals_the_definitions(kernel, normalize):
    """Every output's gradient with respect to every input element (the whole Jacobian, one
    backward per output as gradcheck's analytical side builds it) equals autograd through the
    float64 definition, on gradcheck's inputs with chunks of 2 seeds."""
    inputs = _gradcheck_inputs(_device(kernel))
    opts = _opts(normalize, chunk_size=2)
    jacobian = torch.autograd.functional.jacobian
    ours = jacobian(lambda *a: lev_modes(*a, opts, kernel=kernel), tuple(inputs))
    ref = jacobian(lambda *a: _definition(a, opts), tuple(inputs))
    for name, j, j_ref in zip(_GRAD_NAMES, ours, ref):
        assert j_ref.abs().max() > 0, name
        torch.testing.assert_close(j, j_ref, rtol=1e-11, atol=1e-13, msg=name)


def _constant_spline(values: torch.Tensor, kappa: int) -> torch.Tensor:
    """spline_delta [1, d, kappa, 1] whose spline is the constant values[c] on coordinate c
    (a normalised basis sums to 1)."""
    return (values - 1).view(1, -1, 1, 1).expand(1, values.numel(), kappa, 1).clone()


def _constant_inputs(values, dtype, device, kappa=5, n=4):
    d = values.numel()
    return [
        torch.randn(n, 3, dtype=dtype, device=device),
        torch.randn(1, d, 3, dtype=dtype, device=device),
        torch.ones(1, d, dtype=dtype, device=device),
        torch.zeros(1, d, dtype=dtype, device=device),
        _constant_spline(values, kappa).to(device=device, dtype=dtype),
    ]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_product_survives_partial_overflow(kernel, dtype):
    # Factors 1e30, 1e30, then six exact zeros (each counted as eps = 1e-9): a running float32
    # product overflows after two factors and would stay inf; the spec's exp(sum log) gives
    # 1e60 * 1e-54 = 1e6.
    device = _device(kernel)
    values = torch.tensor([1e30, 1e30, 0, 0, 0, 0, 0, 0], dtype=torch.float64)
    out = lev_modes(*_constant_inputs(values, dtype, device), _opts(), kernel=kernel)
    expected = torch.full((4, 1, 1), 1e6, dtype=torch.float64)
    torch.testing.assert_close(out.double().cpu(), expected, rtol=1e-5, atol=0)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("eps", [1e-30, 1e-9, 1.0])
def test_product_at_the_extremes_of_the_flags_range(kernel, eps):
    # --lev-product-eps anywhere in (0, inf): 64 coordinates, half of them huge factors (1/eps,
    # up to 1e30, alternating signs), half exact zeros (each counted as eps): partial products
    # leave float32's range in both directions; the whole product is moderate.
    device = _device(kernel)
    d, big = 64, (1.0 / eps if eps < 1 else 2.0)
    values = torch.tensor([(-big if c % 4 == 0 else big) if c % 2 == 0 else 0.0
                           for c in range(d)], dtype=torch.float64)  # fmt: skip
    inputs = _constant_inputs(values, torch.float32, device)
    out = lev_modes(*inputs, _opts(eps=eps), kernel=kernel)
    expected = _definition([x.double() for x in inputs], _opts(eps=eps))
    assert torch.isfinite(expected).all() and (expected.abs() > 1e-3).all()
    torch.testing.assert_close(out.double().cpu(), expected.cpu(), rtol=1e-4, atol=0)


@pytest.mark.parametrize("kernel", FUSED)
@pytest.mark.parametrize(
    "dtype, eps, big, zeros, bigs",
    [
        (torch.float32, 1e-45, 1e30, 16, 24),  # float32 rounds eps to 1.4e-45 (subnormal)
        (torch.float32, 1e-60, 1e30, 16, 32),  # float32 flushes eps to 0
        (torch.float64, 1e-200, 1e300, 15, 10),
        (torch.float64, 1e-320, 1e300, 15, 16),  # float64 rounds eps (subnormal)
    ],
)
def test_product_with_eps_below_the_dtypes_range(kernel, dtype, eps, big, zeros, bigs):
    # --lev-product-eps has no lower bound: where phi == 0 the factor is eps itself, exactly,
    # even when the compute dtype cannot hold it. `zeros` such factors are balanced by `bigs`
    # factors of +-big, so that the product is moderate. (The readable `lev.math`, kernel
    # "reference", adds eps in the compute dtype, as docs/lev.md writes it: not exact here.)
    device = _device(kernel)
    values = torch.tensor([0.0] * zeros + [(-big if c % 3 == 0 else big) for c in range(bigs)],
                          dtype=torch.float64)  # fmt: skip
    inputs = _constant_inputs(values, dtype, device)
    out = lev_modes(*inputs, _opts(eps=eps), kernel=kernel)
    expected = _definition([x.double() for x in inputs], _opts(eps=eps))
    assert torch.isfinite(expected).all() and (expected.abs() > 1e-3).all()
    assert (expected.abs() < 1e3).all()
    torch.testing.assert_close(out.double().cpu(), expected.cpu(), rtol=1e-4, atol=0)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_long_product_is_renormalised(kernel, dtype):
    # --lev-seed-dim has no upper bound: 600 factors alternating 0.75 and -1.5 have mantissas
    # whose plain product (0.75^600 = 1e-75) underflows float32; the exact product is
    # 1.125^300 = 2e15.
    device = _device(kernel)
    values = torch.tensor([0.75, -1.5] * 300, dtype=torch.float64)
    inputs = _constant_inputs(values, dtype, device, n=2)
    out = lev_modes(*inputs, _opts(), kernel=kernel)
    expected = _definition([x.double() for x in inputs], _opts())
    assert (expected.abs() > 1e15).all() and torch.isfinite(expected).all()
    rtol = 1e-4 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(out.double().cpu(), expected.cpu(), rtol=rtol, atol=0)


@pytest.mark.parametrize("kernel", KERNELS)
def test_product_underflow_and_overflow_of_the_result(kernel):
    # The product itself out of float32's range: 0 and inf, as exp(sum log) gives.
    device = _device(kernel)
    tiny = lev_modes(*_constant_inputs(torch.full((8,), 1e-6), torch.float32, device), _opts(),
                     kernel=kernel)  # fmt: skip
    huge = lev_modes(*_constant_inputs(torch.full((8,), 1e6), torch.float32, device), _opts(),
                     kernel=kernel)  # fmt: skip
    assert (tiny == 0).all() and torch.isinf(huge).all() and (huge > 0).all()


@pytest.mark.parametrize("kernel", KERNELS)
def test_modes_computed_before_give_the_same_output_and_gradients(kernel):
    # lev_modes(..., modes=M), as the global batch's single backward uses it for the rows of
    # several forwards: M computed earlier under no_grad is returned as it is (the "reference"
    # kernel computes it again), and the gradients are those of the call that computes M.
    device = _device(kernel)
    inputs = _inputs(torch.float64, device=device)
    weight = torch.randn(37, 3, 5, dtype=torch.float64)
    out, grads = _with_grads(lambda: lev_modes(*inputs, _opts(), kernel=kernel), inputs, weight)
    with torch.no_grad():
        modes = lev_modes(*inputs, _opts(), kernel=kernel)
    again, grads_again = _with_grads(
        lambda: lev_modes(*inputs, _opts(), kernel=kernel, modes=modes), inputs, weight
    )
    assert torch.equal(again, out)
    for name, a, b in zip(_GRAD_NAMES, grads, grads_again):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("kernel", KERNELS)
def test_nan_seed_gives_nan_modes(kernel):
    device = _device(kernel)
    inputs = [x.detach() for x in _inputs(torch.float32, device=device)]
    inputs[0][3] = float("nan")
    out = lev_modes(*inputs, _opts(), kernel=kernel)
    assert torch.isnan(out[3]).all() and torch.isfinite(out[:3]).all()


@pytest.mark.parametrize("kernel", KERNELS)
def test_one_and_two_threads_give_the_same_result(kernel):
    device = _device(kernel)
    inputs = _inputs(torch.float64, n=64, device=device)
    weight = torch.randn(64, 3, 5, dtype=torch.float64)
    threads = torch.get_num_threads()
    results = []
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            results.append(
                _with_grads(lambda: lev_modes(*inputs, _opts(), kernel=kernel), inputs, weight)
            )
    finally:
        torch.set_num_threads(threads)
    (one, one_grads), (two, two_grads) = results
    if kernel == "cpu":
        # Each output and each parameter-gradient row is computed by one thread: bitwise equal.
        assert torch.equal(one, two)
        assert all(torch.equal(a, b) for a, b in zip(one_grads, two_grads))
    else:
        torch.testing.assert_close(one, two, rtol=1e-14, atol=0)
        for a, b in zip(one_grads, two_grads):
            torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-15)


@pytest.mark.parametrize("kernel", KERNELS)
def test_saved_for_backward(kernel):
    device = _device(kernel)
    n, d_in, h, d, kappa, r = 50, 5, 3, 16, 6, 8
    inputs = _inputs(torch.float32, n=n, d_in=d_in, h=h, d=d, kappa=kappa, r=r, device=device)
    z, params = inputs[0], inputs[1:]
    size, out = saved_tensor_bytes(
        lambda: lev_modes(z.clone(), *params, _opts(), kernel=kernel), exclude=[z, *params]
    )
    out.sum().backward()
    if kernel == "reference":
        # Plain autograd keeps at least phi [h, n, d, r] and the basis [h, n, d, kappa].
        assert size >= 4 * h * n * d * (r + kappa)
    else:
        # z [n, d_in] (the clone) and M [n, h, r]; no [n, d, r] or [n, d, kappa] tensor.
        assert size == 4 * n * (d_in + h * r)


@pytest.mark.parametrize("kernel", KERNELS)
def test_autocast_keeps_float32(kernel):
    device = _device(kernel)
    inputs = _inputs(torch.float32, device=device)
    exact = lev_modes(*inputs, _opts(), kernel=kernel)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        out = lev_modes(*inputs, _opts(), kernel=kernel)
    assert out.dtype == torch.float32 and torch.equal(out, exact)
    out.sum().backward()
    assert all(x.grad is not None and x.grad.dtype == torch.float32 for x in inputs)


# More distinct ids (20) than codebook rows (k*b = 12, or 16 for k2_kappa3): LEVEmbedding
# projects by digit (`lev.kernels.digit_sum`).
MANY_IDS = [[0, 3, 7, 9, 11, 14, 17, 20, 23, 26], [29, 31, 34, 37, 40, 42, 44, 46, 48, 49]]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("name", ["sum", "concat", "k2_kappa3"])
def test_by_digit_matches_reference_float64(lev, name, kernel):
    _device(kernel)
    cfg = dataclasses.replace(lev.tiny_config(**CONFIGS[name]), kernel=kernel)
    assert len({i for row in MANY_IDS for i in row}) > cfg.num_digits * cfg.base
    module = lev.make_lev(cfg, dtype=torch.float64, spread=1.5)
    weight = torch.randn(2, 10, cfg.hidden_size, dtype=torch.float64)
    ref_out, ref_grads = _reference_and_grads(module, MANY_IDS, weight)
    out, grads = _module_and_grads(module, MANY_IDS, weight)
    torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-10)
    for n, g in grads.items():
        torch.testing.assert_close(g, ref_grads[n], rtol=1e-10, atol=1e-10, msg=n)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("combine", ["sum", "concat"])
def test_kernel_by_digit_equals_the_definition_in_float64(kernel, combine):
    # lev_modes(codebooks, ..., digits=) equals the definition on the seeds the digits form.
    device = _device(kernel)
    k, b, d_c = 3, 4, 5
    z, *params = _inputs(torch.float64, d_in=d_c * (k if combine == "concat" else 1),
                         device=device)  # fmt: skip
    gen = torch.Generator().manual_seed(1)
    codebooks = torch.randn(k, b, d_c, generator=gen, dtype=torch.float64).to(device)
    codebooks.requires_grad_()
    digits = torch.randint(0, b, (z.shape[0], k), generator=gen).to(device)
    inputs = [codebooks, *params]
    opts = _opts(chunk_size=8, combine=combine)
    weight = torch.randn(z.shape[0], 3, 5, dtype=torch.float64)

    def definition():
        return _definition([lev_math.seed(codebooks, digits, combine), *params], opts)

    ref, ref_grads = _with_grads(definition, inputs, weight)
    out, grads = _with_grads(
        lambda: lev_modes(*inputs, opts, kernel=kernel, digits=digits), inputs, weight
    )
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-14)
    for name, g, g_ref in zip(["codebooks", *_GRAD_NAMES[1:]], grads, ref_grads):
        torch.testing.assert_close(g, g_ref, rtol=1e-11, atol=1e-13, msg=name)
    with pytest.raises(ValueError, match="codebooks"):
        lev_modes(codebooks[:, :, :2], *params, opts, kernel=kernel, digits=digits)
    # The combine comes from the options, not from the shapes: the other one is refused.
    other = _opts(chunk_size=8, combine="sum" if combine == "concat" else "concat")
    with pytest.raises(ValueError, match=f"codebook_combine='{other.codebook_combine}'"):
        lev_modes(*inputs, other, kernel=kernel, digits=digits)


def test_kernel_options_carry_the_codebook_combine():
    # LEVEmbedding passes its LEVConfig: the options take its combine, and check it themselves.
    config = LEVConfig(vocab_size=100, hidden_size=8, codebook_combine="concat")
    assert LEVKernelOptions.of(config).codebook_combine == "concat"
    assert LEVKernelOptions().codebook_combine == "sum"
    with pytest.raises(ValueError, match="codebook_combine must be 'sum' or 'concat'"):
        LEVKernelOptions(codebook_combine="mean")


# The C++ kernel takes its vector paths when r is a multiple of 32 bytes (8 floats, 4 doubles),
# in the widest vectors that divide r (64 bytes where the CPU has AVX-512: the forward's product
# and the backward's bucket loop, two vectors at a time where r holds two), and otherwise one
# rank component at a time (the forward's scalar loop, the backward's one-lane vectors); rank
# components are independent, so the first 5 components of an r = 16, 24 or 32 run (on AVX-512
# one 16-float vector, 8-float vectors, two 16-float vectors) are those of an r = 5 run of the
# same inputs. Coefficients up to 1e15 or 1e30 and eps from 1e-30 to 1 take the forward's group
# size (`safe_group`, float32) through 42, 4, 2 and 0 (the per-factor path).
@pytest.mark.parametrize("r", [16, 24, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    "eps, scale", [(1e-9, 1.0), (1e-30, 1.0), (1.0, 1.0), (1.0, 1e-3), (1e-9, 1e15), (1.0, 1e30)]
)
def test_cpu_kernel_vector_paths_equal_its_scalar_paths(dtype, eps, scale, r):
    from megatron_ext.cpu_accel import lev_kernel

    _device("cpu")
    backend = lev_kernel.CPU_BACKEND
    gen = torch.Generator().manual_seed(3)
    h, n, d, kappa = 3, 41, 70, 6
    t = torch.rand(n, h, d, generator=gen, dtype=torch.float64).to(dtype).transpose(0, 1)
    delta = torch.randn(h, d, kappa, r, generator=gen, dtype=torch.float64) * 0.5
    delta[:, :2] *= scale  # the coefficients' range sets the group size
    delta = delta.to(dtype)
    delta[0, 5:9] = -1  # exact zeros: phi == 0, the factor is eps
    grad = torch.randn(h, n, r, generator=gen, dtype=torch.float64).to(dtype).transpose(0, 1)
    opts = _opts(eps=eps)
    narrow = delta[..., :5].contiguous()
    modes = backend.forward(t, delta, opts)
    exactly = dict(rtol=0, atol=0, equal_nan=True)  # bit for bit (inf where the product is)
    torch.testing.assert_close(modes[..., :5], backend.forward(t, narrow, opts), **exactly)
    scaled = grad * modes
    grad_y, grad_delta = backend.backward(t, delta, scaled, opts)
    narrow_y, narrow_delta = backend.backward(t, narrow, scaled[..., :5], opts)
    torch.testing.assert_close(grad_delta[..., :5], narrow_delta, **exactly)
    # dL/dy sums over the r components, in vector lanes on the vector path (another order of
    # the same float sums): with the last 11 components' gradient 0 it is the r = 5 run's.
    padded = torch.cat([scaled[..., :5], torch.zeros(n, h, r - 5, dtype=dtype)], -1)
    grad_y5, _ = backend.backward(t, delta, padded, opts)
    finite = narrow_y.isfinite()
    assert torch.equal(grad_y5.isfinite(), finite)
    if finite.any():  # (a float32 product of two 1e30 factors overflows: no finite dL/dy)
        rtol = 1e-4 if dtype == torch.float32 else 1e-10
        scale_y = float(narrow_y[finite].abs().max())
        torch.testing.assert_close(
            grad_y5[finite], narrow_y[finite], rtol=rtol, atol=rtol * scale_y
        )


def test_cpu_kernel_vector_path_keeps_nan_and_inf():
    # A NaN or inf coefficient turns the forward's fast path off for its head (group size 0);
    # a NaN coordinate gives NaN modes on the fast path, as on the per-factor one.
    from megatron_ext.cpu_accel import lev_kernel

    _device("cpu")
    backend = lev_kernel.CPU_BACKEND
    gen = torch.Generator().manual_seed(4)
    h, n, d, kappa, r = 3, 9, 12, 5, 8
    t = torch.rand(n, h, d, generator=gen).transpose(0, 1).contiguous()
    t[1, 2, 4] = float("nan")
    delta = torch.randn(h, d, kappa, r, generator=gen) * 0.1
    delta[0, 3, :, 2] = float("nan")
    delta[2, 1, :, 6] = float("inf")
    modes = backend.forward(t, delta, _opts())
    narrow = backend.forward(t, delta[..., :5].contiguous(), _opts())
    assert torch.equal(modes[..., :5].isnan(), narrow.isnan())
    assert torch.equal(torch.nan_to_num(modes[..., :5]), torch.nan_to_num(narrow))
    assert modes[:, 0, 2].isnan().all() and modes[2, 1].isnan().all()
    assert modes[:, 2, 6].isinf().any() or modes[:, 2, 6].isnan().any()
    assert torch.isfinite(modes[:, 1][torch.arange(n) != 2]).all()
