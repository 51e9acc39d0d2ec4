"""Plan a fine-tuning job into a memory budget without changing what it learns.

The package is callable: ``memfit.plan(...)`` is :func:`memfit.plan.planner.plan`.
"""

from memfit._callable_module import make_callable
from memfit.config import PLAN_KEYS
from memfit.devices.catalog import Gpu, catalog, find_gpu
from memfit.plan.data_profile import DataProfile
from memfit.plan.planner import LEVERS, Candidate, Plan, plan

__all__ = [
    "LEVERS",
    "PLAN_KEYS",
    "Candidate",
    "DataProfile",
    "Gpu",
    "Plan",
    "catalog",
    "find_gpu",
    "plan",
]

make_callable(__name__, "plan")
