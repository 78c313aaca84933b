"""An independent float64 reference of LEV, written with plain loops straight from the spec.

It shares no code with megatron_ext.lev: digits by integer arithmetic, the basis from the
definition of beta2 knot by knot, the product as the spec writes it, one token, head, coordinate
and mode at a time. Only meant for tiny configurations (it builds a scalar autograd graph);
gradients come from autograd through these loops.
"""

from __future__ import annotations

import torch


def digits_of(i: int, base: int, num_digits: int) -> list[int]:
    """i = sum_m i_m * b^(k-m), most significant digit first."""
    return [(i // base ** (num_digits - 1 - m)) % base for m in range(num_digits)]


def beta2(x):
    if x < 0.5:
        return 0.75 - x * x
    if x < 1.5:
        return 0.5 * (1.5 - x) ** 2
    return x * 0.0


def reference_lev(ids: list[int], params: dict[str, torch.Tensor], cfg) -> torch.Tensor:
    """LEV embeddings [len(ids), D] of a TP=1 parameter set (float64 tensors).

    Args:
        ids: python ints in [0, V).
        params: codebooks, seed_proj, seed_norm_weight, seed_norm_bias, spline_delta, out_proj.
        cfg: a LEVConfig (only its hyper-parameters are read).
    """
    k, b, d = cfg.num_digits, cfg.base, cfg.seed_dim
    h, kappa, r = cfg.num_heads, cfg.num_knots, cfg.rank
    C = params["codebooks"]
    W = params["seed_proj"]
    gain, bias = params["seed_norm_weight"], params["seed_norm_bias"]
    delta, W_out = params["spline_delta"], params["out_proj"]
    rows = []
    for i in ids:
        assert 0 <= i < cfg.vocab_size
        digs = digits_of(i, b, k)
        # Step 2: the seed.
        if cfg.codebook_combine == "sum":
            z = C[0, digs[0]]
            for m in range(1, k):
                z = z + C[m, digs[m]]
        else:
            z = torch.cat([C[m, digs[m]] for m in range(k)])
        e = torch.zeros(W_out.shape[-1], dtype=torch.float64)
        for layer in range(h):
            # Step 3a-b: projection, LayerNorm, sigmoid with temperature.
            u = [sum(W[layer, o, j] * z[j] for j in range(z.shape[0])) for o in range(d)]
            mean = sum(u) / d
            var = sum((uo - mean) ** 2 for uo in u) / d
            t = [
                torch.sigmoid(
                    (
                        (u[o] - mean) / torch.sqrt(var + cfg.norm_eps) * gain[layer, o]
                        + bias[layer, o]
                    )
                    / cfg.temperature
                )
                for o in range(d)
            ]
            # Step 3c: basis per coordinate, knot by knot.
            basis = []
            for o in range(d):
                B = [beta2((kappa - 1) * abs(t[o] - j / (kappa - 1))) for j in range(kappa)]
                if cfg.normalize_basis:
                    total = sum(B)
                    B = [v / total for v in B]
                basis.append(B)
            # Steps 3d-e: spline values and their separable product, mode by mode.
            for rho in range(r):
                log_sum = 0.0
                negatives = 0
                for o in range(d):
                    phi = sum(basis[o][j] * (1.0 + delta[layer, o, j, rho]) for j in range(kappa))
                    log_sum = log_sum + torch.log(torch.abs(phi) + cfg.product_eps)
                    negatives += int(phi.item() < 0)
                mode = (-1.0) ** negatives * torch.exp(log_sum)
                # Step 4.
                e = e + mode * W_out[layer, rho]
        rows.append(e)
    return torch.stack(rows)


def reference_params(module) -> dict[str, torch.Tensor]:
    """float64 leaf copies (requiring grad) of a TP=1 module's parameters."""
    return {
        name: p.detach().to(torch.float64).clone().requires_grad_(True)
        for name, p in module.named_parameters()
    }
