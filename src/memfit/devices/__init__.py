"""The GPUs memfit knows: the catalog of cards (memory as CUDA reports it, rates, bf16) and the
profile of each generation (context, workspaces, kernels). Imports nothing else of memfit's but
``errors``, so ``estimate``, ``plan``, ``report`` and the CLI may all use it.
"""

from memfit.devices.catalog import ASSUMED_GPU, Gpu, catalog, detect_gpu, find_gpu
from memfit.devices.profiles import CudaProfile, cuda_profile

__all__ = ["ASSUMED_GPU", "CudaProfile", "Gpu", "catalog", "cuda_profile", "detect_gpu", "find_gpu"]
