"""The OOM guard: one optimizer step as micro-batches that survive out-of-memory, same gradient.

:class:`Guard` splits a step and backs off (and grows back) on OOM; :func:`memory_cap` and
:class:`CpuMemoryCap` make OOM real under a chosen budget, on the CPU too, so the recovery path
is tested for real rather than with a hand-raised error.
"""

from memfit.guard.cap import CpuMemoryCap, memory_cap
from memfit.guard.guard import Guard, StepTooLarge, is_oom

__all__ = ["CpuMemoryCap", "Guard", "StepTooLarge", "is_oom", "memory_cap"]
