"""LEV's fused modes: one autograd Function over pluggable backends (`--lev-kernel`).

    z [N, d_in] --(torch: seed projection)--> u --(SeedNorm)--> y,  t = sigmoid(y) [h, N, d]
    t, Delta [h, d, kappa, r] --(backend.forward)--> M [N, h, r]

`LEVModes` owns what the backends share (autocast off, the compute dtype, steps 3a-3b, saving
only z and M, recomputing t in backward, casting gradients back). A backend implements steps
3c-3e (B-spline basis, spline values with coefficients 1 + Delta, signed product):

    forward(t [h, N, d], delta [h, d, kappa, r], opts) -> M [N, h, r]
    backward(t, delta, grad = dL/dM * M [N, h, r], opts) -> (dL/dy [h, N, d], dL/dDelta)

Backends: "torch" (`lev.fused`), "cpu" (`cpu_accel.lev_kernel`, C++), "triton"
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
    """Steps 3c-3e and their gradient (see the module docstring for shapes)."""

    name: str

    def forward(self, t: torch.Tensor, delta: torch.Tensor, opts: LEVKernelOptions) -> torch.Tensor:
        """t [h, N, d], delta [h, d, kappa, r] -> M [N, h, r] (coefficients 1 + delta)."""
        ...

    def backward(
        self, t: torch.Tensor, delta: torch.Tensor, grad: torch.Tensor, opts: LEVKernelOptions
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """grad = dL/dM * M [N, h, r] -> (dL/dy [h, N, d], dL/dDelta [h, d, kappa, r]), with
        t = sigmoid(y): dL/dy = dL/dt * t * (1 - t)."""
        ...


def _project(
    z: torch.Tensor, seed_proj: torch.Tensor, digits: Optional[torch.Tensor], combine: str
) -> torch.Tensor:
    """Step 3a for all h heads: u [N, h*d] = z @ W^T, with W = seed_proj as [h*d, d_in].

    With `digits` [N, k], z is the codebooks [k, b, d_c]: u is linear in the k codebook rows
    that form a seed, so it is the sum of k rows of P_m = C_m @ W_m^T ([b, h*d]; W_m = W for
    "sum", the m-th column block of W for "concat"), one small GEMM instead of an [N, d_in]
    one. Worth it when N > k*b (LEVEmbedding decides).
    """
    h, d, d_in = seed_proj.shape
    if digits is None:
        return torch.matmul(z, seed_proj.reshape(h * d, d_in).t())
    k, b, _ = z.shape
    digit_proj = digit_projection(z, seed_proj, combine)
    offsets = torch.arange(k, device=digits.device, dtype=digits.dtype) * b
    return F.embedding_bag(digits + offsets, digit_proj.reshape(k * b, h * d), mode="sum")


def digit_projection(codebooks: torch.Tensor, seed_proj: torch.Tensor, combine: str):
    """P [k, b, h*d] = C_m @ W_m^T of the codebooks [k, b, d_c] (W_m = W for "sum"; for
    "concat" the m-th block of d_c columns of W)."""
    h, d, d_in = seed_proj.shape
    weight = seed_proj.reshape(h * d, d_in)
    if combine == "sum":
        return torch.matmul(codebooks, weight.t())
    k, _, d_c = codebooks.shape
    return torch.bmm(codebooks, weight.view(h * d, k, d_c).permute(1, 2, 0))


class SeedNorm(Protocol):
    """Step 3b up to the sigmoid, y = LayerNorm(u) * gain + shift per (id, head) row (gain,
    shift: the LayerNorm's weight and bias over the temperature), and its backward. u, y, dL/dy
    contiguous [N, h, d]; gain, shift [h, d]. A backend may carry its own as `seed_norm`."""

    def forward(
        self, u: torch.Tensor, gain: torch.Tensor, shift: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """-> y [N, h, d]."""
        ...

    def backward(
        self, u: torch.Tensor, gain: torch.Tensor, grad_y: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> (dL/du [N, h, d], dL/dgain [h, d], dL/dshift [h, d])."""
        ...


class TorchSeedNorm:
    """`SeedNorm` in torch ops: layer_norm and addcmul, their autograd for the backward."""

    def forward(self, u, gain, shift, eps):
        """(LN(u) * g + b) / tau = LN(u) * (g / tau) + b / tau: one addcmul after layer_norm."""
        return torch.addcmul(shift, F.layer_norm(u, (u.shape[-1],), eps=eps), gain)

    def backward(self, u, gain, grad_y, eps):
        """The local autograd graph of `forward`."""
        inputs = [x.detach().requires_grad_() for x in (u, gain, torch.zeros_like(gain))]
        with torch.enable_grad():
            y = self.forward(*inputs, eps)
        return tuple(torch.autograd.grad(y, inputs, grad_y))


TORCH_SEED_NORM = TorchSeedNorm()


def _seed_norm(backend: LEVBackend) -> SeedNorm:
    return getattr(backend, "seed_norm", None) or TORCH_SEED_NORM


def _seed_to_t(
    z: torch.Tensor,
    seed_proj: torch.Tensor,
    norm_params: tuple[torch.Tensor, torch.Tensor],
    norm: SeedNorm,
    opts: LEVKernelOptions,
    digits: Optional[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Steps 3a-3b in the compute dtype -> (u [N, h, d], with the projection's autograd graph
    where grad is enabled; gain [h, d]; t = sigmoid(y) [N, h, d], no graph)."""
    h, d, _ = seed_proj.shape
    u = _project(z, seed_proj, digits, opts.codebook_combine).view(-1, h, d)
    gain, shift = (p.detach() / opts.temperature for p in norm_params)
    with torch.no_grad():
        t = norm.forward(u.detach(), gain, shift, opts.norm_eps).sigmoid_()
    return u, gain, t


class LEVModes(torch.autograd.Function):
    """z [N, d_in] -> M [N, h, r] through `backend`; saves z, the parameters and M (and the
    digits). The h projections are one GEMM (`_project`), the backend's `SeedNorm` gives y and
    t = sigmoid(y) (backends get t's [h, N, d] view); backward: the backend's to dL/dy, the
    SeedNorm's to dL/du, autograd through the projection.
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
                norm_params = (norm_weight.to(cdt), norm_bias.to(cdt))
                _, _, t = _seed_to_t(
                    z.to(cdt), seed_proj.to(cdt), norm_params, _seed_norm(backend), opts, digits
                )
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
        norm = _seed_norm(ctx.backend)
        need_z, need_w, need_g, need_b, need_delta = ctx.needs_input_grad[:5]
        with torch.autocast(device_type=z.device.type, enabled=False):
            cdt = modes.dtype
            weight = seed_proj.detach().to(cdt).requires_grad_(need_w)
            zc = z.detach().to(cdt).requires_grad_(need_z)
            norm_params = (norm_weight.to(cdt), norm_bias.to(cdt))
            with torch.enable_grad():
                u, gain, t = _seed_to_t(zc, weight, norm_params, norm, opts, digits)
            delta = spline_delta.detach().to(cdt).contiguous()
            # dL/dM * M laid out [h, N, r] (each head's rows one block), passed as [N, h, r].
            scaled = modes.new_empty(modes.shape[1], modes.shape[0], modes.shape[2])
            torch.mul(grad_modes.to(cdt).transpose(0, 1), modes.transpose(0, 1), out=scaled)
            with torch.no_grad():
                grad_y, grad_delta = ctx.backend.backward(
                    t.transpose(0, 1), delta, scaled.transpose(0, 1), opts
                )
                # SeedNorm reads dL/dy in y's own [N, h, d] layout (a no-op for backends that
                # write it so).
                grad_y = grad_y.transpose(0, 1).contiguous()
                grad_u, grad_gain, grad_shift = norm.backward(
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
    if kernel == "cpu" or (kernel == "auto" and z.device.type == "cpu"):
        if kernel == "auto":
            available = cpu_kernel_available()
            return cpu_accel.lev_backend().CPU_BACKEND if available else fused.TORCH_BACKEND
        if z.device.type != "cpu":
            raise RuntimeError(
                f"--lev-kernel cpu runs on CPU tensors, but LEV's input is on {z.device}; "
                "use --lev-kernel auto"
            )
        kernel_module = cpu_accel.lev_backend()
        if kernel_module is None:
            raise RuntimeError(
                f"--lev-kernel cpu is one of the CPU accelerations, and {cpu_accel.OFF}; use "
                "--lev-kernel auto or torch"
            )
        error = kernel_module.cpu_kernel_error()
        if error is not None:
            raise RuntimeError(error)
        return kernel_module.CPU_BACKEND
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
            2-3a by digit, `_project`); seed_proj [h, d, d_in]; norm_weight, norm_bias [h, d];
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
            cdt = lev_math.compute_dtype(z.dtype)
            if digits is not None:
                z = lev_math.seed(z, digits, opts.codebook_combine)
            return lev_math.lev_modes(
                z.to(cdt),
                *(p.to(cdt) for p in (seed_proj, norm_weight, norm_bias, spline_delta)),
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
