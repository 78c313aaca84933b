"""`BatchSizeRampup`: Megatron-LM's --rampup-batch-size as a schedule of consumed samples, the
counterpart of megatron-core's `RampupBatchsizeNumMicroBatchesCalculator`.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BatchSizeRampup"]


@dataclass(frozen=True)
class BatchSizeRampup:
    """Megatron-LM's --rampup-batch-size START INCREMENT SAMPLES: the global batch grows from
    START by INCREMENT in equal steps of consumed samples, reaching the full global batch size
    after SAMPLES samples. A function of consumed samples only, so a resumed run continues it."""

    start: int
    increment: int
    ramp_samples: int
    global_batch_size: int
    micro_times_dp: int

    def __post_init__(self) -> None:
        if self.start < 1 or self.increment < 1 or self.ramp_samples < 0:
            raise ValueError(
                "--rampup-batch-size needs START >= 1, INCREMENT >= 1 and SAMPLES >= 0, got "
                f"{self.start} {self.increment} {self.ramp_samples}"
            )
        diff = self.global_batch_size - self.start
        if diff < 0 or diff % self.increment:
            raise ValueError(
                f"--rampup-batch-size: --global-batch-size {self.global_batch_size} minus START "
                f"{self.start} must be a non-negative multiple of INCREMENT {self.increment}"
            )
        for name, value in (("START", self.start), ("INCREMENT", self.increment)):
            if value % self.micro_times_dp:
                raise ValueError(
                    f"--rampup-batch-size {name} {value} is not divisible by --micro-batch-size "
                    f"x data-parallel size = {self.micro_times_dp}; every ramp batch must split "
                    "into whole micro-batches"
                )

    def global_batch(self, consumed_samples: int) -> int:
        """The global batch size of the iteration that starts after `consumed_samples`."""
        steps = (self.global_batch_size - self.start) // self.increment
        if steps == 0 or consumed_samples >= self.ramp_samples:
            return self.global_batch_size
        per_step = self.ramp_samples / steps
        size = self.start + int(consumed_samples / per_step) * self.increment
        return min(size, self.global_batch_size)

    def iterations_for(self, train_samples: int) -> int:
        """Iterations that consume `train_samples` samples (Megatron's update_train_iters)."""
        consumed, iterations = 0, 0
        while consumed <= self.ramp_samples and consumed <= train_samples:
            consumed += self.global_batch(consumed)
            iterations += 1
        if consumed < train_samples:
            iterations += (train_samples - consumed) // self.global_batch_size
        return iterations
