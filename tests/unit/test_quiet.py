"""memfit.quiet: the third-party lines that say nothing to the user are dropped wherever memfit is
imported (the CLI, the Python API, the Trainer integrations), each by its logger (or warning
category and module) and message; the same loggers' other lines and the user's own warnings show.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import subprocess
import sys
import warnings

import pytest

from cli_run import run_cli
from memfit import quiet

# each dropped line as its library logs it today (message, arguments)
LOGGED = {
    "bitsandbytes.backends.cpu.ops": (
        "Failed to load CPU gemm_4bit_forward from kernels-community: %s. Please make sure you "
        "already `pip install kernels` and the kernels >= 0.11.1",
        (ModuleNotFoundError("No module named 'kernels'"),),
    ),
    "transformers.modeling_utils": (
        "`loss_type=None` was set in the config but it is unrecognized. Using the default loss: "
        "`ForCausalLMLoss`.",
        (),
    ),
    "DeepSpeed": (
        "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to "
        "detect it.",
        (),
    ),
}
PIN_MEMORY = (
    "'pin_memory' argument is set as true but no accelerator is found, then device pinned memory "
    "won't be used."
)


class _Kept(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _handled(logger_name: str, message: str, args: tuple[object, ...] = ()) -> list[str]:
    """What a handler on ``logger_name`` receives of one WARNING record through memfit.quiet's
    filters (the logger's level, which a library or TRANSFORMERS_VERBOSITY sets, and the CLI's
    own filter of DeepSpeed's warnings, memfit.runtime.quiet_deepspeed, left out)."""
    logger = logging.getLogger(logger_name)
    others = [f for f in logger.filters if not isinstance(f, quiet._DropNoise)]
    kept = _Kept()
    logger.addHandler(kept)
    for other in others:
        logger.removeFilter(other)
    try:
        logger.handle(
            logger.makeRecord(logger_name, logging.WARNING, "x.py", 1, message, args, None)
        )
    finally:
        logger.removeHandler(kept)
        for other in others:
            logger.addFilter(other)
    return kept.messages


def test_every_filtered_line_is_listed_once_with_its_reason() -> None:
    assert sorted(n.logger for n in quiet.LOG_NOISE) == sorted(LOGGED)
    assert all(n.why for n in (*quiet.LOG_NOISE, *quiet.WARNING_NOISE))


@pytest.mark.parametrize("logger_name", sorted(LOGGED))
def test_the_line_is_dropped_and_the_loggers_other_lines_pass(logger_name: str) -> None:
    quiet.install()
    message, args = LOGGED[logger_name]
    assert _handled(logger_name, message, args) == []
    # another line of the same logger, and the same line from another logger, pass
    assert _handled(logger_name, "Something the user should read") == [
        "Something the user should read"
    ]
    assert _handled(f"{logger_name}.other", message, args) == [message % args]


def _warned(*, inside: bool) -> list[str]:
    """The warnings shown of the dataloader's pin_memory one, another of its module and the
    user's own, warned inside memfit.quiet.calls() or outside it (after install())."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.resetwarnings()  # every warning shown, but those memfit.quiet drops
        quiet.install()
        with quiet.calls() if inside else contextlib.nullcontext():
            for text, module in (
                (PIN_MEMORY, "torch.utils.data.dataloader"),
                ("another warning of the dataloader", "torch.utils.data.dataloader"),
                ("the user's own warning", "__main__"),
            ):
                warnings.warn_explicit(text, UserWarning, "f.py", 1, module=module, registry={})
    return [str(w.message) for w in seen]


def test_the_pin_memory_warning_is_dropped_in_memfits_calls_and_other_warnings_show() -> None:
    assert _warned(inside=True) == ["another warning of the dataloader", "the user's own warning"]


def test_outside_memfits_calls_the_users_own_dataloader_still_warns() -> None:
    # a warning is reported from the module that raises it whoever called: a process-wide filter
    # would hide the user's own DataLoader(pin_memory=True) warning too
    assert _warned(inside=False)[0] == PIN_MEMORY


def test_install_adds_each_log_filter_once_and_calls_leave_the_warnings_filters_as_they_were() -> (
    None
):
    with warnings.catch_warnings():
        warnings.resetwarnings()
        warnings.simplefilter("error")
        before = list(warnings.filters)
        quiet.install()
        quiet.install()
        assert warnings.filters == before
        with quiet.calls():
            assert len(warnings.filters) == len(before) + len(quiet.WARNING_NOISE)
        assert warnings.filters == before
    for name in LOGGED:
        drops = [f for f in logging.getLogger(name).filters if isinstance(f, quiet._DropNoise)]
        assert len(drops) == 1, name


def test_the_cli_leaves_the_levels_of_bitsandbytes_loggers_alone(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The line is dropped by its message: bitsandbytes' other warnings (a GPU it cannot use, a
    CUDA library it cannot find) still show in a memfit command."""
    # another test in this process may have set it (tests/unit/estimate/test_quantized.py does)
    bnb = logging.getLogger("bitsandbytes")
    before = bnb.level
    bnb.setLevel(logging.NOTSET)
    try:
        code, _, _ = run_cli(capsys, "gpus")
        level = bnb.level
        ops = logging.getLogger("bitsandbytes.backends.cpu.ops").getEffectiveLevel()
    finally:
        bnb.setLevel(before)
    assert code == 0
    assert level == logging.NOTSET
    assert ops <= logging.WARNING


# the libraries' real calls, in a fresh process each (bitsandbytes and DeepSpeed log theirs as
# they are imported), with memfit imported first or not at all
_SCRIPT = """
import logging, warnings
{memfit}
import bitsandbytes  # logs the `kernels` line on a CPU with AVX512-BF16
logging.getLogger("bitsandbytes.backends.cpu.ops").warning("bitsandbytes: another line")
from transformers import GPT2Config, GPT2LMHeadModel
model = GPT2LMHeadModel(GPT2Config(
    n_layer=1, n_embd=8, n_head=2, vocab_size=16, n_positions=8, bos_token_id=0, eos_token_id=0
))
model.loss_function  # transformers: loss_type=None (GPT-2's config has none)
logging.getLogger("transformers.modeling_utils").warning("transformers: another line")
import torch
list(torch.utils.data.DataLoader([1, 2], pin_memory=True))  # torch: no accelerator to pin for
{deepspeed}
warnings.warn("the user's own warning")
"""


@pytest.mark.slow
def test_the_libraries_lines_are_gone_after_import_memfit_and_their_other_lines_stay() -> None:
    pytest.importorskip("bitsandbytes")
    has_deepspeed = importlib.util.find_spec("deepspeed") is not None
    env = {k: v for k, v in os.environ.items() if k != "TRANSFORMERS_VERBOSITY"}
    runs = {
        with_memfit: subprocess.Popen(
            [
                sys.executable,
                "-c",
                _SCRIPT.format(
                    memfit="import memfit" if with_memfit else "",
                    deepspeed="import deepspeed" if has_deepspeed else "",
                ),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,  # DeepSpeed logs to stdout
            text=True,
        )
        for with_memfit in (False, True)
    }
    output = {}
    for with_memfit, process in runs.items():
        output[with_memfit], _ = process.communicate(timeout=300)
        assert process.returncode == 0, output[with_memfit]
    lines = {
        "bitsandbytes": "Failed to load CPU gemm_4bit_forward from kernels-community",
        "transformers": "`loss_type=None` was set in the config but it is unrecognized",
        "deepspeed": "Setting accelerator to CPU",
    }
    # the script's own DataLoader: its warning is the user's, and stays (memfit drops it only
    # inside its own calls, memfit.quiet.calls())
    pin_memory = "'pin_memory' argument is set as true but no accelerator is found"
    assert (pin_memory in output[False]) == (pin_memory in output[True]), output[True]
    # without memfit the libraries say so (bitsandbytes on AVX512-BF16 CPUs only, DeepSpeed
    # without a GPU): each line seen there is gone with memfit imported first
    assert lines["transformers"] in output[False], output[False]
    seen = [name for name, line in lines.items() if line in output[False]]
    assert [name for name in seen if lines[name] in output[True]] == [], output[True]
    for kept in ("bitsandbytes: another line", "transformers: another line", "the user's own"):
        assert kept in output[True], output[True]
