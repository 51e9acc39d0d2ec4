"""GPUs by name: memory as PyTorch reports it, bf16 support, peak FLOP rates, bandwidth.

The figures live in ``gpus.json`` next to this file, with their sources: vendor datasheets for the
rates (dense tensor-core rates with float32 accumulation, plain FP32 without TF32, since PyTorch
does not use TF32 for matmuls by default) and, for memory, ``total_memory`` as CUDA reports it
(real out-of-memory messages and device queries), which is below the marketing figure. The host
link (``host_link_gbps``) is what one GPU can copy to or from pinned host memory per second in one
direction: its PCIe generation and width (PCI-SIG's rate per lane after 128b/130b encoding) times
the 80 % that pinned copies reach in practice; offloaded activations, offloaded optimizer state and
paged optimizers move over it.
"""

from __future__ import annotations

import difflib
import functools
import json
from dataclasses import dataclass
from importlib import resources
from typing import Any

from memfit.devices.profiles import attention_kernels
from memfit.errors import UsageError


@dataclass(frozen=True)
class Gpu:
    """One GPU model: what the planner needs to know about it."""

    id: str
    name: str
    memory_bytes: int
    bf16: bool
    tflops: dict[str, float | None]
    memory_bandwidth_gbps: float
    sm_count: int
    compute_capability: tuple[int, int]
    aliases: tuple[str, ...] = ()
    # GB/s one direction between pinned host memory and this GPU (every catalog entry gives its
    # own, ``gpus.json``); a Gpu built without one (an unknown card's nearest generation gives
    # its own) gets :data:`DEFAULT_HOST_LINK_GBPS`
    host_link_gbps: float = 0.0
    # what a user of this GPU should know (a PyTorch that no longer runs on it), or empty
    support_note: str = ""

    def __post_init__(self) -> None:
        if self.host_link_gbps <= 0:
            # frozen: the documented default goes in through object.__setattr__
            object.__setattr__(self, "host_link_gbps", DEFAULT_HOST_LINK_GBPS)

    @property
    def short_name(self) -> str:
        """The name people say: ``T4``, ``RTX 3060 12GB``, ``A100 40GB`` (vendor, brand and the
        parenthesised form factor left out)."""
        name = self.name.split(" (")[0]
        for prefix in ("NVIDIA ", "GeForce ", "Tesla "):
            name = name.removeprefix(prefix)
        return name

    @property
    def possessive(self) -> str:
        """``a T4's``, ``an RTX 3060 12GB's``: for verdicts such as "fits in a T4's 14.56 GiB"."""
        return f"{_article(self.short_name)} {self.short_name}'s"

    def budget_words(self, size: str, *, is_its_memory: bool) -> str:
        """A budget of ``size`` (formatted) on this GPU as a verdict says it: ``a T4's 14.56 GiB``
        (its memory), ``12.00 GiB on a T4`` (another budget on it)."""
        if is_its_memory:
            return f"{self.possessive} {size}"
        return f"{size} on {_article(self.short_name)} {self.short_name}"

    @property
    def capability(self) -> str:
        """``sm75`` for compute capability 7.5."""
        return f"sm{self.compute_capability[0]}{self.compute_capability[1]}"

    @property
    def attention_kernels(self) -> tuple[str, ...]:
        """The SDPA kernels PyTorch runs on it, best first (no flash attention before sm80)."""
        return attention_kernels(self.compute_capability)

    def precision_problem(self, precision: str, flag: str = "--precision") -> str | None:
        """Why ``precision`` cannot train on this GPU (bf16 before sm80), or None."""
        if precision == "bf16" and not self.bf16:
            return (
                f"{flag} bf16: the {self.short_name} ({self.capability}) has no bf16 (it needs "
                "compute capability 8.0 or later); use --precision fp16"
            )
        return None

    def flops_per_second(self, precision: str) -> float:
        """Peak FLOP/s for matmuls in ``precision`` (fp32 | fp16 | bf16)."""
        rate = self.tflops.get(precision)
        if rate is None:  # bf16 on a GPU without it: never planned, but answer something
            rate = self.tflops["fp32"]
        return float(rate or 0.0) * 1e12

    def mixed_precision(self) -> str:
        """The mixed precision this GPU should train in: bf16 where it has it, else fp16."""
        return "bf16" if self.bf16 else "fp16"


@functools.cache
def _load() -> dict[str, Any]:
    text = resources.files("memfit.devices").joinpath("gpus.json").read_text(encoding="utf-8")
    data: dict[str, Any] = json.loads(text)
    return data


@functools.cache
def catalog() -> dict[str, Gpu]:
    """Every GPU in the catalog, by id, smallest memory first."""
    gpus = {}
    for gpu_id, entry in _load()["gpus"].items():
        major, minor = (int(x) for x in str(entry["compute_capability"]).split("."))
        gpus[gpu_id] = Gpu(
            id=gpu_id,
            name=entry["name"],
            memory_bytes=int(entry["memory_bytes"]),
            bf16=bool(entry["bf16"]),
            tflops=dict(entry["tflops"]),
            memory_bandwidth_gbps=float(entry["memory_bandwidth_gbps"]),
            sm_count=int(entry["sm_count"]),
            compute_capability=(major, minor),
            aliases=tuple(entry.get("aliases", ())),
            host_link_gbps=float(entry["host_link_gbps"]),
            support_note=str(entry.get("support_note", "")),
        )
    return dict(sorted(gpus.items(), key=lambda kv: (kv[1].memory_bytes, kv[0])))


def _article(name: str) -> str:
    """``a`` or ``an`` as the name is said aloud: an A100, an H100, an L4, an RTX 3060, a T4."""
    first = name[:1].upper()
    return "an" if first in "AEFHILMNORSX8" or name.startswith(("11", "18")) else "a"


def _key(name: str) -> str:
    return name.strip().lower().replace("_", "-").replace(" ", "-")


def find_gpu(name: str, flag: str = "--gpu") -> Gpu:
    """The catalog GPU called ``name`` (its id or an alias, any case); exit-2 error otherwise."""
    gpus = catalog()
    wanted = _key(name)
    for gpu in gpus.values():
        if wanted == _key(gpu.id) or wanted in {_key(a) for a in gpu.aliases}:
            return gpu
    close = difflib.get_close_matches(wanted, list(gpus), n=3, cutoff=0.5)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    raise UsageError(f"{flag}: unknown GPU {name!r}{hint} (known: {', '.join(gpus)})")


# what --gpu-memory alone assumes for speed: an A100-class GPU (bf16, its rates)
ASSUMED_GPU = "a100-80gb"
# the host link of a Gpu that names none: PCIe 3.0 x16 at 80 % of its 15.75 GB/s per direction,
# the slowest link a current card sits on (an offloading plan errs slow, not fast)
DEFAULT_HOST_LINK_GBPS = 12.6


def detect_gpu() -> tuple[Gpu, int, int] | None:
    """The GPU of this machine: (catalog entry if known, total bytes, free bytes); None without."""
    try:
        # start-up: the GPU catalog is read by quick verbs that never load torch
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        return None
    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(0)
    free, total = torch.cuda.mem_get_info(0)
    known: Gpu | None = None
    for gpu in catalog().values():
        names = {_key(gpu.name), *(_key(a) for a in gpu.aliases)}
        if _key(props.name) in names or _key(props.name.replace("NVIDIA ", "")) in names:
            known = gpu
            break
    if known is None:
        # an unknown GPU: its own memory and capability, rates of the nearest generation
        major, minor = props.major, props.minor
        base = catalog()["h100-80gb" if major >= 9 else "a100-80gb" if major >= 8 else "v100-32gb"]
        known = Gpu(
            id=props.name,
            name=props.name,
            memory_bytes=int(total),
            bf16=major >= 8,
            tflops=base.tflops,
            memory_bandwidth_gbps=base.memory_bandwidth_gbps,
            host_link_gbps=base.host_link_gbps,
            sm_count=props.multi_processor_count,
            compute_capability=(major, minor),
        )
    return known, int(total), int(free)
