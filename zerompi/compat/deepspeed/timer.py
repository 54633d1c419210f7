"""``engine.tput_timer``: DeepSpeed's throughput timer, as training scripts use it.

DeepSpeed's engine starts it at each forward and stops it at each ``step()``, and scripts read it
(DeepSpeed-Chat calls ``engine.tput_timer.update_epoch_count()`` after each epoch; others print
``avg_samples_per_sec()``). Timing starts after ``start_step`` optimizer steps, so that the first,
slow steps do not count; before then the average is ``-inf``, as DeepSpeed answers. It measures
wall time on this rank and prints nothing.
"""
from __future__ import annotations

import time

__all__ = ["ThroughputTimer"]


class ThroughputTimer:
    """Wall time from each ``start()`` to the next ``stop()``, summed over the steps after ``start_step``."""

    def __init__(self, batch_size: int | None, start_step: int = 2):
        self.batch_size = batch_size or 1  # samples per optimizer step (train_batch_size)
        self.start_step = start_step
        self.epoch_count = 0
        self.micro_step_count = 0
        self.global_step_count = 0
        self.total_elapsed_time = 0.0
        self.step_elapsed_time = 0.0
        self._started: float | None = None

    def update_epoch_count(self) -> None:
        """An epoch ended (the script says so)."""
        self.epoch_count += 1
        self.micro_step_count = 0

    def start(self) -> None:
        """A forward begins (a second start before stop keeps the first time)."""
        if self._started is None:
            self._started = time.perf_counter()

    def stop(self, global_step: bool = False, report_speed: bool = True) -> None:
        """``step()`` ran; ``global_step``: it ended an accumulation window. ``report_speed`` is
        accepted for DeepSpeed's signature; nothing is printed."""
        if self._started is None:
            return
        elapsed = time.perf_counter() - self._started
        self._started = None
        self.micro_step_count += 1
        if global_step:
            self.global_step_count += 1
        if self.global_step_count > self.start_step:
            self.total_elapsed_time += elapsed
            self.step_elapsed_time += elapsed
            if global_step:
                self.step_elapsed_time = 0.0

    def avg_samples_per_sec(self) -> float:
        """Samples per second over the timed steps (``-inf`` until a step past ``start_step`` is timed)."""
        steps = self.global_step_count - self.start_step
        if steps <= 0 or self.total_elapsed_time <= 0:
            return float("-inf")
        return self.batch_size * steps / self.total_elapsed_time
