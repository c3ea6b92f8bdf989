"""``profile.enabled=true profile.steps=[a,b]``: a ``torch.profiler`` trace of training steps a..b (inclusive).

The trace is written by ``torch.profiler.tensorboard_trace_handler`` to ``profile.dir`` (default
``RUN_DIR/profile``), one ``<rank>.<time>.pt.trace.json`` per profiled rank: open it in Perfetto
(ui.perfetto.dev, "Open trace file") or ``chrome://tracing``, or point TensorBoard's profiler plugin at the
folder. Each step is a ``record_function`` range named ``step N`` and, on GPU, an NVTX range of the same name,
so ``nsys profile --capture-range=cudaProfilerApi`` sees the same steps (the CUDA profiler is started and stopped
around them). Only ``profile.ranks`` are profiled (default rank 0).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


class StepProfiler:
    """Profiles the steps ``profile.steps[0]..profile.steps[1]`` of this rank; a no-op when disabled.

    Args:
        profile: the ``profile`` config group: ``enabled``, ``steps`` ([first, last], 1-based steps),
            ``ranks``, ``dir`` (null: ``RUN_DIR/profile``), ``record_shapes``, ``profile_memory``, ``with_stack``.
        run_dir: ``RUN_DIR``.
        rank: this process's global rank.
        on_gpu: also profile CUDA activity and emit NVTX ranges.
    Raises:
        ValueError: ``profile.steps`` is not two steps ``1 <= first <= last``.
    """

    def __init__(self, profile: Mapping[str, Any] | None, run_dir: str | Path, rank: int, on_gpu: bool):
        profile = dict(profile or {})
        self.enabled = bool(profile.get("enabled")) and rank in list(profile.get("ranks") or [0])
        steps = list(profile.get("steps") or [1, 1])
        if len(steps) != 2 or not 1 <= int(steps[0]) <= int(steps[1]):
            raise ValueError(f"profile.steps={steps}: two optimizer steps [first, last] with 1 <= first <= last")
        self.first, self.last = int(steps[0]), int(steps[1])
        self.on_gpu, self.rank = on_gpu, rank
        self.dir = Path(profile.get("dir") or Path(run_dir) / "profile")
        self.options = {k: bool(profile.get(k, False)) for k in ("record_shapes", "profile_memory", "with_stack")}
        self._profiler: Any = None

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Wrap optimizer step ``step`` (1-based): starts the profiler at the first step, names the step's range,
        and writes the trace after the last one."""
        if not self.enabled or not self.first <= step <= self.last:
            yield
            return
        import torch  # only when profiling: utils loads no heavy package at import
        from torch.profiler import ProfilerActivity, profile, record_function, tensorboard_trace_handler

        if self._profiler is None:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.on_gpu else [])
            self._profiler = profile(
                activities=activities,
                on_trace_ready=tensorboard_trace_handler(str(self.dir), worker_name=f"rank{self.rank}"),
                **self.options,
            )
            self._profiler.start()
            if self.on_gpu:
                torch.cuda.profiler.start()
        name = f"step {step}"
        if self.on_gpu:
            torch.cuda.nvtx.range_push(name)
        try:
            with record_function(name):
                yield
        finally:
            if self.on_gpu:
                torch.cuda.nvtx.range_pop()
        if step == self.last:
            self.stop()

    def stop(self) -> None:
        """Write the trace of the steps profiled so far (the run ended or stopped before ``profile.steps[1]``)."""
        if self._profiler is None:
            return
        if self.on_gpu:
            import torch  # as in step

            torch.cuda.profiler.stop()
        self._profiler.stop()
        self._profiler = None
        log.info("profile of steps %d-%d written to %s", self.first, self.last, self.dir)
