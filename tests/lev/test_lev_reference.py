"""The fast paths equal an independent float64 reference written with plain loops from
docs/lev.md section 2.

The reference below shares no code with megatron_ext.lev: digits by integer arithmetic, the
basis knot by knot from the definition of beta2, the separable product exactly as docs/lev.md
writes it (sign * exp(sum log(|phi| + 1e-9))), one token, head, coordinate and mode at a time.
Its gradients come from autograd through those loops.
"""

import dataclasses

import pytest
import torch

from megatron_ext.lev import LEVConfig, fused_lev_modes


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


@pytest.mark.parametrize("name", list(CONFIGS))
def test_matches_reference_float64(lev, name):
    cfg = lev.tiny_config(**CONFIGS[name])
    module = lev.make_lev(cfg, dtype=torch.float64, spread=1.5)
    weight = torch.randn(2, 6, cfg.hidden_size, dtype=torch.float64)
    ref_out, ref_grads = _reference_and_grads(module, IDS, weight)
    assert (ref_out.abs() > 1e-3).any()
    # The fused path through each CPU implementation (lev.cpu_fused, lev.fused), and the plain one.
    for kernel in ("cpu", "torch", "reference"):
        for dedup in (True, False):
            module.lev_config = dataclasses.replace(cfg, kernel=kernel, dedup=dedup)
            out, grads = _module_and_grads(module, IDS, weight)
            where = f"kernel={kernel} dedup={dedup}"
            torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-10, msg=where)
            for n, g in grads.items():
                torch.testing.assert_close(
                    g, ref_grads[n], rtol=1e-10, atol=1e-10, msg=f"{n} {where}"
                )


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


def test_matches_reference_float32(lev):
    cfg = lev.tiny_config(chunk_size=4)  # several chunks in the fused path
    module = lev.make_lev(cfg, dtype=torch.float32, spread=0.3)
    weight = torch.randn(2, 6, cfg.hidden_size, dtype=torch.float64)
    ref_out, ref_grads = _reference_and_grads(module, IDS, weight)
    out, grads = _module_and_grads(module, IDS, weight)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref_out, rtol=1e-4, atol=1e-4)
    for n, g in grads.items():
        torch.testing.assert_close(g.double(), ref_grads[n], rtol=1e-4, atol=1e-4, msg=n)


def test_gradcheck_fused_function():
    torch.manual_seed(0)
    n, d_in, h, d, kappa, r = 5, 3, 2, 3, 4, 2
    inputs = (
        torch.randn(n, d_in, dtype=torch.float64),
        0.7 * torch.randn(h, d, d_in, dtype=torch.float64),
        1 + 0.3 * torch.randn(h, d, dtype=torch.float64),
        0.3 * torch.randn(h, d, dtype=torch.float64),
        0.5 * torch.randn(h, d, kappa, r, dtype=torch.float64),
    )
    inputs = tuple(x.requires_grad_(True) for x in inputs)
    for normalize in (True, False):
        # The fused function reads only the scalars; V and D do not enter it.
        cfg = LEVConfig(
            vocab_size=1, hidden_size=1, num_knots=kappa, normalize_basis=normalize, chunk_size=2
        )
        assert torch.autograd.gradcheck(lambda *a: fused_lev_modes(*a, cfg), inputs)


def test_bf16_autocast_keeps_float32_product(lev):
    cfg = lev.tiny_config()
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
