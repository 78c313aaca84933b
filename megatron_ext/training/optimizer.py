"""AdamW with Megatron's parameter groups, optional ZeRO-1 (torch's
`ZeroRedundancyOptimizer` over the data-parallel group), grad-norm clipping that counts
tensor-parallel duplicates once, and FP16 loss scaling, on gloo and NCCL alike.

Parameters, gradients and Adam states are float32; --bf16 / --fp16 run under autocast
(`precision.py`), so there is no low-precision master weight and DP reduces in float32.
"""

from __future__ import annotations

import math
from typing import Iterable, Optional

import megatron_ext.megatron_import  # noqa: F401

import torch
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron_ext.config.run import OptimizerConfig
from megatron_ext.parallel import ProcessGroups
from megatron_ext.training.unique_params import counted_params, model_parallel_sum

__all__ = [
    "Optimizer",
    "build_scheduler",
    "param_groups",
    "all_finite",
    "clip_grad_norm",
    "LossScaler",
    "is_decoupled_param",
]


def is_decoupled_param(name: str) -> bool:
    """Whether --decoupled-lr applies to parameter `name`: Megatron-LM applies it to the input
    embedding and the output layer; here the input embedding is the whole arm (for LEV: every
    LEV generator parameter)."""
    return name.startswith("embedding.") or name.startswith("output_layer.")


def _no_weight_decay(name: str, param: torch.Tensor) -> bool:
    """Megatron's rule (biases and 1-D parameters) plus any normalisation parameter, such as
    LEV's per-head seed_norm_weight/bias, which are 2-D."""
    leaf = name.rsplit(".", 1)[-1]
    return param.dim() <= 1 or leaf.endswith("bias") or "norm" in leaf


def param_groups(
    model: torch.nn.Module,
    cfg: Optional[OptimizerConfig] = None,
    decoupled: Optional[tuple[float, float]] = None,
) -> list[dict]:
    """AdamW groups: decayed (wd_mult 1) and not decayed (wd_mult 0), by Megatron's rule.

    The parameters of a module with `param_settings` (`engine.ModuleHooks`) follow those
    instead; with an lr multiplier != 1 they form their own groups with `max_lr`/`min_lr` from
    `cfg`. With `decoupled` = (--decoupled-lr, --decoupled-min-lr), the input embedding and
    output layer form groups with that lr (times a module's multiplier). The base groups are
    kept even when empty, so that ranks have the same group structure (the scheduler walks it)."""
    own: dict[int, tuple[bool, float, str]] = {
        key: (*setting, module.engine_name)
        for module in model.modules()
        if hasattr(module, "param_settings")
        for key, setting in module.param_settings().items()
    }
    base = [False, True] if decoupled is not None else [False]
    groups: dict[tuple[bool, float, bool, str], list] = {
        (decay, 1.0, dec, ""): [] for dec in base for decay in (True, False)
    }
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        decay, lr_mult, owner = own.get(id(param), (not _no_weight_decay(name, param), 1.0, ""))
        dec = decoupled is not None and is_decoupled_param(name)
        groups.setdefault((decay, lr_mult, dec, owner if lr_mult != 1.0 else ""), []).append(param)
    out = []
    for (decay, lr_mult, dec, owner), params in groups.items():
        name = ("decoupled_" if dec else "") + ("decay" if decay else "no_decay")
        group = {"params": params, "wd_mult": 1.0 if decay else 0.0, "name": name}
        if lr_mult != 1.0:
            group["name"] += f"_{owner}"
            if cfg is None and not dec:
                raise ValueError("param_groups: an lr multiplier needs the OptimizerConfig")
        if dec or lr_mult != 1.0:
            lr, min_lr = decoupled if dec else (cfg.lr, cfg.min_lr)
            group.update(max_lr=lr * lr_mult, min_lr=min_lr * lr_mult)
        out.append(group)
    return out


class Optimizer:
    """AdamW, or ZeRO-1 over `zero_group` (`ProcessGroups.dp_cp` under
    --use-distributed-optimizer); `decoupled` = (--decoupled-lr, --decoupled-min-lr) for the
    embedding and output layer. `owned_state()` and `set_state()` expose the Adam states this
    rank keeps (all of them, or its ZeRO share), keyed by the parameter tensor."""

    def __init__(
        self,
        model: torch.nn.Module,
        cfg: OptimizerConfig,
        zero_group=None,
        decoupled: Optional[tuple[float, float]] = None,
    ) -> None:
        self.params = [p for p in model.parameters() if p.requires_grad]
        groups = param_groups(model, cfg, decoupled)
        kwargs = dict(
            lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps, weight_decay=0.0
        )
        if self.params and all(p.device.type == "cpu" for p in self.params):
            # torch's fused CPU kernel: one vectorised pass per parameter instead of the
            # for-loop's ~10 ops; the same update within an ulp.
            kwargs["fused"] = True
        self.distributed = zero_group is not None
        if self.distributed:
            # ZeroRedundancyOptimizer drops empty groups at construction; keep only filled ones
            # (the no-decay group always has the norm weights).
            groups = [g for g in groups if g["params"]]
            # deferred: torch.distributed.optim TorchScript-compiles its functional optimizers
            # when imported (~0.3 CPU-s of every training process that never uses it)
            from torch.distributed.optim import ZeroRedundancyOptimizer

            self.inner = ZeroRedundancyOptimizer(
                groups,
                optimizer_class=torch.optim.AdamW,
                process_group=zero_group,
                parameters_as_bucket_view=False,
                **kwargs,
            )
        else:
            self.inner = torch.optim.AdamW(groups, **kwargs)

    @property
    def param_groups(self) -> list[dict]:
        """The inner optimizer's groups (the LR scheduler writes lr and weight_decay here)."""
        return self.inner.param_groups

    @property
    def _local(self) -> torch.optim.Optimizer:
        return self.inner.optim if self.distributed else self.inner

    def owns(self, param: torch.Tensor) -> bool:
        """Whether this rank keeps (and updates) `param`'s Adam state."""
        groups = self._local.param_groups
        return not self.distributed or any(param is p for g in groups for p in g["params"])

    def owned_state(self) -> dict[torch.Tensor, dict]:
        """Parameter -> Adam state of the parameters this rank owns (with a state yet)."""
        return {p: s for p, s in self._local.state.items() if s}

    def set_state(self, param: torch.Tensor, state: dict) -> None:
        """Install `param`'s Adam state (when loading a checkpoint)."""
        self._local.state[param] = state

    def zero_grad(self) -> None:
        """Drop every gradient (set to None)."""
        for param in self.params:
            param.grad = None

    def step(self) -> None:
        """One AdamW step (with ZeRO-1: on this rank's share, then broadcast)."""
        self.inner.step()

    def get_lr(self) -> float:
        """The current learning rate (of the first group)."""
        return self.param_groups[0]["lr"]


def build_scheduler(optimizer: Optimizer, cfg: OptimizerConfig):
    """megatron-core's OptimizerParamScheduler (Megatron-LM's exact schedule, in samples)."""
    return OptimizerParamScheduler(
        optimizer,
        init_lr=cfg.lr_warmup_init,
        max_lr=cfg.lr,
        min_lr=cfg.min_lr,
        lr_warmup_steps=cfg.lr_warmup_steps,
        lr_decay_steps=cfg.lr_decay_steps,
        lr_decay_style=cfg.lr_decay_style,
        start_wd=cfg.start_weight_decay,
        end_wd=cfg.end_weight_decay,
        wd_incr_steps=cfg.wd_incr_steps,
        wd_incr_style=cfg.weight_decay_incr_style,
        use_checkpoint_opt_param_scheduler=cfg.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=cfg.override_opt_param_scheduler,
        wsd_decay_steps=cfg.lr_wsd_decay_steps,
        lr_wsd_decay_style=cfg.lr_wsd_decay_style,
    )


def all_finite(tensors: Iterable[torch.Tensor]) -> bool:
    """Whether every element of every tensor is finite (one host sync per tensor)."""
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def clip_grad_norm(params: list[torch.Tensor], max_norm: float, pg: ProcessGroups) -> float:
    """Global gradient L2 norm across TP and PP (`pg.mp`; grads already identical across DP);
    scale the gradients down to `max_norm` when it is exceeded (0 disables clipping).

    Returns:
        the norm before clipping (nan/inf if any gradient is not finite; nothing is scaled).
    """
    grads = [p.grad for p in counted_params(params, pg.tp_rank) if p.grad is not None]
    local = torch.stack(torch._foreach_norm(grads, 2.0)).double().square().sum() if grads else 0
    total = model_parallel_sum(float(local), pg)
    norm = math.sqrt(total) if math.isfinite(total) else total
    if max_norm > 0 and math.isfinite(norm):
        coeff = max_norm / (norm + 1e-6)
        if coeff < 1.0:
            all_grads = [p.grad for p in params if p.grad is not None]
            torch._foreach_mul_(all_grads, coeff)
    return norm


class LossScaler:
    """FP16 loss scaling: static (`--loss-scale`) or dynamic as in Megatron-LM (halve after
    `hysteresis` overflowing steps, double after `window` clean ones, never below `min_scale`)."""

    def __init__(
        self,
        static_scale: Optional[float] = None,
        initial_scale: float = 2.0**32,
        min_scale: float = 1.0,
        window: int = 1000,
        hysteresis: int = 2,
    ) -> None:
        self.dynamic = static_scale is None
        self.scale = float(static_scale if static_scale is not None else initial_scale)
        self.min_scale, self.window, self.hysteresis = min_scale, window, hysteresis
        self._clean_steps, self._hysteresis_left = 0, hysteresis

    def update(self, found_inf: bool) -> None:
        """Adjust a dynamic scale after a step that did (True) or did not overflow."""
        if not self.dynamic:
            return
        if found_inf:
            self._clean_steps = 0
            self._hysteresis_left -= 1
            if self._hysteresis_left <= 0:
                self.scale = max(self.scale / 2.0, self.min_scale)
        else:
            self._clean_steps += 1
            if self._clean_steps % self.window == 0:
                self.scale *= 2.0
                self._hysteresis_left = self.hysteresis

    def state_dict(self) -> dict:
        """Scale and counters, saved in checkpoints."""
        return {
            "scale": self.scale,
            "clean_steps": self._clean_steps,
            "hysteresis_left": self._hysteresis_left,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore a dynamic scale and its counters (a static scale keeps its flag value)."""
        if self.dynamic:
            self.scale = float(state["scale"])
            self._clean_steps = int(state["clean_steps"])
            self._hysteresis_left = int(state["hysteresis_left"])
