"""The GPU catalog: the cards people fine-tune on, by the names they type, with sourced memory."""

from __future__ import annotations

import json
import re
from importlib import resources

import pytest

from memfit.devices import catalog, find_gpu
from memfit.errors import UsageError

# what people type -> a word the card's name must hold (the model, and its memory where a model
# comes in more than one size)
TYPED = {
    "3060": "3060 12GB",
    "rtx-3060": "3060",
    "rtx3060-12gb": "3060 12GB",
    "RTX 3070": "3070 8GB",
    "3080": "3080 10GB",
    "3080-12gb": "3080 12GB",
    "rtx-3080-12gb": "3080 12GB",
    "2080ti": "2080 Ti",
    "rtx-2080-ti": "2080 Ti",
    "4060": "4060 8GB",
    "4060ti": "4060 Ti 16GB",
    "rtx4060ti-16gb": "4060 Ti 16GB",
    "4070": "4070 12GB",
    "rtx-4080": "4080 16GB",
    "5090": "5090 32GB",
    "kaggle-p100": "P100",
    "Tesla P100-PCIE-16GB": "P100",
    "tesla k80": "K80",
    "b200": "B200",
}

# marketing sizes (GB as the box says, here 2^30 bytes at most) of the cards above
MARKETED_GIB = {"3060": 12, "3070": 8, "3080 10GB": 10, "3080 12GB": 12, "2080 Ti": 11,
                "4060 8GB": 8, "4060 Ti": 16, "4070": 12, "4080": 16, "5090": 32, "P100": 16,
                "K80": 12, "B200": 180}  # fmt: skip


def _entries() -> dict[str, dict[str, object]]:
    text = resources.files("memfit.devices").joinpath("gpus.json").read_text(encoding="utf-8")
    entries: dict[str, dict[str, object]] = json.loads(text)["gpus"]
    return entries


@pytest.mark.parametrize("typed", sorted(TYPED))
def test_the_cards_people_fine_tune_on_resolve_by_what_they_type(typed: str) -> None:
    gpu = find_gpu(typed)
    assert TYPED[typed] in gpu.name
    # as CUDA reports it: below the marketing figure, not above
    marketed = next(v for k, v in MARKETED_GIB.items() if k in gpu.name)
    assert 0.9 * marketed * 2**30 < gpu.memory_bytes < marketed * 2**30


def test_every_card_says_where_its_memory_comes_from() -> None:
    for gpu_id, entry in _entries().items():
        note = str(entry["memory_note"])
        sourced = re.search(r"https://\S+", note) is not None
        # no printout found: derived from a measured card, or said to be weakly sourced
        honest = note.startswith("Derived") or "weakly sourced" in note or "less firmly" in note
        assert sourced or honest or gpu_id in _DATASHEET_ERA, gpu_id
        if note.startswith("Derived"):
            # the measured card it is derived from is named with its source
            assert "https://" in note, gpu_id


# entries from before this catalog grew, sourced in _sources by their exact figures
_DATASHEET_ERA = {"v100-16gb", "v100-32gb", "a10g", "l4", "a100-40gb", "a100-80gb", "h100-80gb",
                  "h100-pcie", "h200", "l40s", "a10", "rtx-a6000", "rtx3090", "rtx4090", "t4"}  # fmt: skip


def test_aliases_are_unique_and_every_card_is_complete() -> None:
    seen: dict[str, str] = {}
    for gpu in catalog().values():
        for name in (gpu.id, *gpu.aliases):
            key = name.strip().lower().replace("_", "-").replace(" ", "-")
            assert seen.setdefault(key, gpu.id) == gpu.id, f"{name} names two GPUs"
        assert find_gpu(gpu.id) is gpu
        # bf16 exactly from sm80 (Ampere), and a bf16 rate only where there is bf16
        assert gpu.bf16 == (gpu.compute_capability >= (8, 0)), gpu.id
        assert (gpu.tflops.get("bf16") is None) == (not gpu.bf16), gpu.id
        assert gpu.sm_count > 0 and gpu.memory_bandwidth_gbps > 0
        assert gpu.tflops[gpu.mixed_precision()], gpu.id
    short = [g.short_name for g in catalog().values()]
    assert len(short) == len(set(short))


def test_kernels_by_generation() -> None:
    for gpu in catalog().values():
        kernels = gpu.attention_kernels
        assert kernels[-1] == "math"
        assert ("flash" in kernels) == (gpu.compute_capability >= (8, 0)), gpu.id
        assert ("mem-efficient" in kernels) == (gpu.compute_capability >= (5, 0)), gpu.id
    assert find_gpu("k80").attention_kernels == ("math",)
    assert "PyTorch" in find_gpu("k80").support_note  # sm37: no current wheel runs it


def test_bf16_is_refused_before_sm80_naming_the_gpu() -> None:
    for gpu in catalog().values():
        problem = gpu.precision_problem("bf16")
        if gpu.bf16:
            assert problem is None
        else:
            assert problem is not None and gpu.short_name in problem and "fp16" in problem
        assert gpu.precision_problem("fp16") is None


@pytest.mark.parametrize(
    ("typed", "article"),
    [("t4", "a"), ("v100", "a"), ("p100", "a"), ("k80", "a"), ("b200", "a"), ("a10g", "an"),
     ("h100", "an"), ("l4", "an"), ("3060", "an"), ("2080ti", "an")],
)  # fmt: skip
def test_possessive_reads_aloud(typed: str, article: str) -> None:
    gpu = find_gpu(typed)
    assert gpu.possessive == f"{article} {gpu.short_name}'s"


def test_unknown_gpu_is_a_usage_error_naming_the_flag() -> None:
    with pytest.raises(UsageError, match="--gpu"):
        find_gpu("rtx-9090")


def test_a_kaggle_p100_oom_message_is_read_as_the_p100() -> None:
    # the P100-PCIE-16GB's total (17071734784 bytes) is what its OOM messages print, 15.90 GiB:
    # the doctor then knows the GPU, and that it has no bf16
    from memfit.report.doctor_cures import gpu_of
    from memfit.report.oom_message import parse_oom

    report = parse_oom(
        "CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 15.90 GiB total capacity; "
        "14.93 GiB already allocated; 7.75 MiB free; 15.02 GiB reserved in total by PyTorch)"
    )
    assert report is not None
    card = gpu_of(report)
    assert card is not None and card.id == "p100" and not card.bf16


def test_every_card_names_its_host_link_and_a_gpu_without_one_gets_the_default() -> None:
    from memfit.devices.catalog import DEFAULT_HOST_LINK_GBPS, Gpu

    for gpu_id, entry in _entries().items():
        # written out in the data file, with the link it is (not left to the default)
        assert float(entry["host_link_gbps"]) > 0, gpu_id  # type: ignore[arg-type]
        assert str(entry["host_link"]).startswith(("PCIe", "NVLink")), gpu_id
        assert catalog()[gpu_id].host_link_gbps == entry["host_link_gbps"]
    # PCIe 3.0 x16 < 4.0 x16 < 5.0 x16; the RTX 4060 Ti sits on 4.0 x8
    links = [find_gpu(n).host_link_gbps for n in ("t4", "a100-80gb", "h100-80gb")]
    assert links == sorted(links) and links[0] < links[1] < links[2]
    assert find_gpu("4060ti").host_link_gbps == find_gpu("t4").host_link_gbps
    built = Gpu("x", "x", 2**30, True, {"fp32": 1.0}, 100.0, 1, (8, 0))
    assert built.host_link_gbps == DEFAULT_HOST_LINK_GBPS == 12.6
