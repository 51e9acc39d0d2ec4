"""The OOM guard: one optimizer step as micro-batches that survive out-of-memory, same gradient.

:class:`Guard` splits a step and backs off (and grows back) on OOM; :func:`memory_cap` and
:class:`CpuMemoryCap` make OOM real under a chosen budget, on the CPU too, so the recovery path
is tested for real rather than with a hand-raised error. The back-off policy every guarded loop
follows (halve, grow back, agree across ranks) is :mod:`memfit.guard.policy`; catching an OOM and
cleaning up after it, :mod:`memfit.guard.oom`.
"""

from memfit.guard.cap import CpuMemoryCap, memory_cap
from memfit.guard.guard import Guard, StepTooLarge
from memfit.guard.oom import is_oom

__all__ = ["CpuMemoryCap", "Guard", "StepTooLarge", "is_oom", "memory_cap"]
