"""LEV's fused modes: one autograd Function over pluggable backends (`--lev-kernel`).

    z [N, d_in] --(seed projection, backend.seed_norm)--> y,  t = sigmoid(y) [h, N, d]
    t, Delta [h, d, kappa, r] --(backend.forward)--> M [N, h, r]

`LEVModes` owns what the backends share: autocast off, the compute dtype, steps 3a-3b, saving
only z and M, recomputing t in backward, casting gradients back. A backend (`LEVBackend`)
implements steps 3c-3e: "torch" (`lev.fused`), "cpu" (`cpu_accel.lev_kernel`, C++), "triton"
(`lev.triton_kernel`); "reference" is `lev.math.lev_modes` under autograd; "auto" picks triton
on float32 CUDA, cpu on CPU when its kernel builds, else torch. All compute the same function;
the signed product multiplies frexp mantissas and sums exponents (docs/lev.md step 3e).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import logging
from dataclasses import dataclass
from typing import Optional, Protocol, Union

import torch
import torch.nn.functional as F

from megatron_ext import cpu_accel
from megatron_ext.config.lev import LEVConfig
from megatron_ext.lev import fused
from megatron_ext.lev import math as lev_math

__all__ = [
    "KERNELS",
    "LEVBackend",
    "LEVKernelOptions",
    "LEVModes",
    "cpu_kernel_available",
    "cpu_kernel_error",
    "digit_projection",
    "digit_sum",
    "lev_modes",
    "select_backend",
    "triton_importable",
]

logger = logging.getLogger(__name__)

KERNELS = ("auto", "reference", "torch", "triton", "cpu")
"""The values of `--lev-kernel` (`LEVConfig.kernel`)."""


@dataclass(frozen=True)
class LEVKernelOptions:
    """What a LEV kernel needs besides its tensors (kappa, r, h, d come from their shapes)."""

    temperature: float = 2.0  # tau in t = sigmoid(LayerNorm(u) / tau)
    norm_eps: float = 1e-5  # LayerNorm epsilon
    normalize_basis: bool = True  # renormalise the B-spline basis to sum 1
    product_eps: float = 1e-9  # eps in sign * exp(sum log(|phi| + eps))
    chunk_size: int = 0  # ids per chunk of the torch backend (0: about 2M spline values)
    # How k codebook rows form a seed when `lev_modes` gets codebooks and digits: "sum"
    # (d_c = d_in) or "concat" (k*d_c = d_in).
    codebook_combine: str = "sum"

    def __post_init__(self) -> None:
        if not self.temperature > 0 or not self.norm_eps > 0 or not self.product_eps > 0:
            raise ValueError(
                "LEVKernelOptions: temperature, norm_eps and product_eps must be > 0, got "
                f"{self.temperature}, {self.norm_eps}, {self.product_eps}"
            )
        if self.chunk_size < 0:
            raise ValueError(f"LEVKernelOptions: chunk_size must be >= 0, got {self.chunk_size}")
        if self.codebook_combine not in ("sum", "concat"):
            raise ValueError(
                "LEVKernelOptions: codebook_combine must be 'sum' or 'concat', got "
                f"{self.codebook_combine!r}"
            )

    @classmethod
    def of(cls, config: Union["LEVKernelOptions", LEVConfig]) -> "LEVKernelOptions":
        """The options of a `LEVConfig` (or `config` itself when it already is options)."""
        if isinstance(config, cls):
            return config
        return cls(**{f.name: getattr(config, f.name) for f in dataclasses.fields(cls)})


class LEVBackend(Protocol):
    """Steps 3c-3e and their gradient, and `seed_norm`: step 3b up to the sigmoid,
    y = LayerNorm(u) * gain + shift per (id, head) row, `forward(u, gain, shift, eps) -> y` and
    `backward(u, gain, dL/dy, eps) -> (dL/du, dL/dgain, dL/dshift)` (u, y, dL/dy contiguous
    [N, h, d]; gain, shift: the LayerNorm's weight and bias over tau, [h, d])."""

    name: str
    seed_norm: object

    def forward(self, t: torch.Tensor, delta: torch.Tensor, opts: LEVKernelOptions) -> torch.Tensor:
        """t [h, N, d], delta [h, d, kappa, r] -> M [N, h, r] (coefficients 1 + delta)."""
        ...

    def backward(
        self, t: torch.Tensor, delta: torch.Tensor, grad: torch.Tensor, opts: LEVKernelOptions
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """grad = dL/dM * M [N, h, r] -> (dL/dy [h, N, d], dL/dDelta [h, d, kappa, r]), with
        t = sigmoid(y): dL/dy = dL/dt * t * (1 - t)."""
        ...


def digit_projection(codebooks: torch.Tensor, seed_proj: torch.Tensor, combine: str):
    """P [k, b, h*d] = C_m @ W_m^T of the codebooks [k, b, d_c] (W = seed_proj as [h*d, d_in];
    W_m = W for "sum", for "concat" the m-th block of d_c columns of W)."""
    h, d, d_in = seed_proj.shape
    weight = seed_proj.reshape(h * d, d_in)
    if combine == "sum":
        return torch.matmul(codebooks, weight.t())
    k, _, d_c = codebooks.shape
    return torch.bmm(codebooks, weight.view(h * d, k, d_c).permute(1, 2, 0))


def digit_sum(digit_proj: torch.Tensor, digits: torch.Tensor) -> torch.Tensor:
    """u [N, h*d] = sum_m P[m, digits[:, m]] of P [k, b, h*d] (`digit_projection`)."""
    k, b, width = digit_proj.shape
    offsets = torch.arange(k, device=digits.device, dtype=digits.dtype) * b
    return F.embedding_bag(digits + offsets, digit_proj.reshape(k * b, width), mode="sum")


def _seed_to_t(z, seed_proj, norm_weight, norm_bias, backend, opts, digits):
    """Steps 3a-3b in z's dtype -> (u [N, h, d], with the projection's autograd graph where
    grad is enabled; gain [h, d]; t = sigmoid(y) [N, h, d], no graph).

    Step 3a for all h heads is one GEMM, u = z @ W^T. With `digits` [N, k], z is the codebooks
    [k, b, d_c]: u is linear in the k codebook rows that form a seed, so it is the sum of k rows
    of `digit_projection`, one small GEMM instead of an [N, d_in] one. Worth it when N > k*b
    (LEVEmbedding decides).
    """
    h, d, d_in = seed_proj.shape
    if digits is None:
        u = torch.matmul(z, seed_proj.reshape(h * d, d_in).t()).view(-1, h, d)
    else:
        u = digit_sum(digit_projection(z, seed_proj, opts.codebook_combine), digits).view(-1, h, d)
    gain, shift = (p.detach().to(z.dtype) / opts.temperature for p in (norm_weight, norm_bias))
    with torch.no_grad():
        t = backend.seed_norm.forward(u.detach(), gain, shift, opts.norm_eps).sigmoid_()
    return u, gain, t


class LEVModes(torch.autograd.Function):
    """z [N, d_in] -> M [N, h, r] through `backend`; saves z, the parameters and M (and the
    digits). `_seed_to_t` gives t = sigmoid(y) (backends get its [h, N, d] view); backward:
    the backend's to dL/dy, its `seed_norm`'s to dL/du, autograd through the projection.
    """

    @staticmethod
    def forward(
        ctx, z, seed_proj, norm_weight, norm_bias, spline_delta, backend, opts, digits, modes
    ):
        """Shapes as `lev_modes`; `backend` a LEVBackend, `opts` LEVKernelOptions; `modes` M
        computed earlier for these inputs, or None."""
        if modes is None:
            with torch.autocast(device_type=z.device.type, enabled=False), torch.no_grad():
                cdt = lev_math.compute_dtype(z.dtype)
                zc, weight = z.to(cdt), seed_proj.to(cdt)
                _, _, t = _seed_to_t(zc, weight, norm_weight, norm_bias, backend, opts, digits)
                modes = backend.forward(t.transpose(0, 1), spline_delta.to(cdt).contiguous(), opts)
        ctx.backend, ctx.opts, ctx.has_digits = backend, opts, digits is not None
        saved = (z, seed_proj, norm_weight, norm_bias, spline_delta, modes)
        ctx.save_for_backward(*saved, *([digits] if digits is not None else []))
        return modes

    @staticmethod
    def backward(ctx, grad_modes):
        """grad_modes [N, h, r] -> gradients of z and the four parameters (None: not needed)."""
        z, seed_proj, norm_weight, norm_bias, spline_delta, modes, *digits = ctx.saved_tensors
        digits = digits[0] if ctx.has_digits else None
        opts: LEVKernelOptions = ctx.opts
        need_z, need_w, need_g, need_b, need_delta = ctx.needs_input_grad[:5]
        with torch.autocast(device_type=z.device.type, enabled=False):
            cdt = modes.dtype
            weight = seed_proj.detach().to(cdt).requires_grad_(need_w)
            zc = z.detach().to(cdt).requires_grad_(need_z)
            with torch.enable_grad():
                u, gain, t = _seed_to_t(
                    zc, weight, norm_weight, norm_bias, ctx.backend, opts, digits
                )
            delta = spline_delta.detach().to(cdt).contiguous()
            # dL/dM * M laid out [h, N, r] (each head's rows one block), passed as [N, h, r].
            scaled = modes.new_empty(modes.shape[1], modes.shape[0], modes.shape[2])
            torch.mul(grad_modes.to(cdt).transpose(0, 1), modes.transpose(0, 1), out=scaled)
            with torch.no_grad():
                grad_y, grad_delta = ctx.backend.backward(
                    t.transpose(0, 1), delta, scaled.transpose(0, 1), opts
                )
                # seed_norm reads dL/dy in y's [N, h, d] layout (backends may write it so).
                grad_y = grad_y.transpose(0, 1).contiguous()
                grad_u, grad_gain, grad_shift = ctx.backend.seed_norm.backward(
                    u.detach(), gain, grad_y, opts.norm_eps
                )
            inputs = [x for x in (zc, weight) if x.requires_grad]
            grads = list(torch.autograd.grad(u, inputs, grad_u)) if inputs else []
        grad_z = grads.pop(0).to(z.dtype) if need_z else None
        grad_w = grads.pop(0).to(seed_proj.dtype) if need_w else None
        grad_g = (grad_gain / opts.temperature).to(norm_weight.dtype) if need_g else None
        grad_b = (grad_shift / opts.temperature).to(norm_bias.dtype) if need_b else None
        grad_delta = grad_delta.to(spline_delta.dtype) if need_delta else None
        return (grad_z, grad_w, grad_g, grad_b, grad_delta, None, None, None, None)


@functools.lru_cache(maxsize=None)
def triton_importable() -> bool:
    """True when the triton package is installed (checked once, without importing it)."""
    return importlib.util.find_spec("triton") is not None


def cpu_kernel_error() -> Optional[str]:
    """Why the C++ CPU kernel cannot run here (the accelerations are off, or it does not
    build), or None."""
    kernel = cpu_accel.lev_backend()
    return cpu_accel.OFF if kernel is None else kernel.cpu_kernel_error()


@functools.lru_cache(maxsize=None)
def cpu_kernel_available() -> bool:
    """Whether the CPU kernel is usable; logs the reason once when it is not."""
    error = cpu_kernel_error()
    if error is not None:
        # Turned off on purpose: worth a note; a kernel that does not build: a warning.
        level = logging.INFO if error == cpu_accel.OFF else logging.WARNING
        logger.log(level, "LEV runs the torch backend on CPU (slower): %s", error)
    return error is None


def select_backend(kernel: str, z: torch.Tensor) -> LEVBackend:
    """The backend that `--lev-kernel kernel` runs for seeds z [N, d_in] ("reference" has none).

    Raises:
        RuntimeError: "triton" or "cpu" asked for where it cannot run (one line saying what to
            change).
        ValueError: an unknown kernel name.
    """
    if kernel == "torch":
        return fused.TORCH_BACKEND
    if kernel == "auto" and z.device.type == "cpu":
        return (
            cpu_accel.lev_backend().CPU_BACKEND if cpu_kernel_available() else fused.TORCH_BACKEND
        )
    if kernel == "cpu":
        if z.device.type != "cpu":
            raise RuntimeError(
                f"--lev-kernel cpu runs on CPU tensors, but LEV's input is on {z.device}; "
                "use --lev-kernel auto"
            )
        error = cpu_kernel_error()
        if error == cpu_accel.OFF:
            error = f"--lev-kernel cpu is one of the CPU accelerations, and {error}; use "
            error += "--lev-kernel auto or torch"
        if error is not None:
            raise RuntimeError(error)
        return cpu_accel.lev_backend().CPU_BACKEND
    cdt = lev_math.compute_dtype(z.dtype)
    if kernel == "auto":
        if not (z.is_cuda and cdt == torch.float32 and triton_importable()):
            return fused.TORCH_BACKEND
    elif kernel != "triton":
        raise ValueError(f"unknown LEV kernel {kernel!r}; choose one of {', '.join(KERNELS)}")
    # optional: this module imports Triton (slow) where it is installed
    from megatron_ext.lev import triton_kernel

    triton_kernel.check_triton_usable(z.device, cdt)
    return triton_kernel.TRITON_BACKEND


def lev_modes(
    z: torch.Tensor,
    seed_proj: torch.Tensor,
    norm_weight: torch.Tensor,
    norm_bias: torch.Tensor,
    spline_delta: torch.Tensor,
    opts: Union[LEVKernelOptions, LEVConfig],
    kernel: str = "auto",
    digits: Optional[torch.Tensor] = None,
    modes: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """LEV steps 3a-3e (`lev.math.lev_modes`) through `--lev-kernel kernel`.

    Args:
        z: [N, d_in] seeds, or with `digits` the codebooks [k, b, d_c] that form them (steps
            2-3a by digit, `_seed_to_t`); seed_proj [h, d, d_in]; norm_weight, norm_bias [h, d];
            spline_delta [h, d, kappa, r] (h = heads on this rank).
        opts: the kernel options (a `LEVConfig` is converted by `LEVKernelOptions.of`).
        kernel: one of KERNELS.
        digits: [N, k] int64 digits (`lev.math.to_digits`) of the codebook rows that form
            each seed (`opts.codebook_combine`).
        modes: M [N, h, r] computed earlier for the same inputs under no_grad: only recorded
            for backward (`LEVEmbedding`'s global batch; "reference" computes M again).
    Returns:
        M: [N, h, r] in float32 (float64 if z is float64), whatever the autocast state.
    """
    opts = LEVKernelOptions.of(opts)
    d_in = seed_proj.shape[2]
    if digits is not None:
        concat = opts.codebook_combine == "concat"
        width = z.shape[0] * z.shape[2] if concat and z.dim() == 3 else z.shape[-1]
        if z.dim() != 3 or width != d_in:
            rule = "k*d_c" if concat else "d_c"
            raise ValueError(
                f"lev_modes: with digits, z must be the codebooks [k, b, d_c] with {rule} = "
                f"seed_proj.shape[2] = {d_in} (codebook_combine={opts.codebook_combine!r}); got "
                f"z {tuple(z.shape)}"
            )
    if kernel == "reference":
        with torch.autocast(device_type=z.device.type, enabled=False):
            if digits is not None:
                z = lev_math.seed(z, digits, opts.codebook_combine)
            return lev_math.lev_modes(
                z,
                seed_proj,
                norm_weight,
                norm_bias,
                spline_delta,
                temperature=opts.temperature,
                num_knots=spline_delta.shape[2],
                normalize_basis=opts.normalize_basis,
                norm_eps=opts.norm_eps,
                product_eps=opts.product_eps,
            )
    backend = select_backend(kernel, z)
    return LEVModes.apply(
        z, seed_proj, norm_weight, norm_bias, spline_delta, backend, opts, digits, modes
    )
