"""GuardedSFTTrainer: chunks of a TRL micro-batch give the stock SFTTrainer's gradient (≤ 1e-5,
fp32, CPU, dropout off) for completion-only rows and for padding-free and packed batches (cut at
sequence boundaries), an OOM half-way through a step is re-run to the same gradient and the same
logged metrics, and TRL's activation offloading context wraps each chunk once."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("trl")

from memfit.integrations import GuardedSFTTrainer
from tiny_models import SENTENCES, save_tiny_llama

ROWS = [
    {"prompt": "what is two plus two", "completion": " it is four"},
    {"prompt": "name a colour", "completion": " blue is a colour"},
    {"prompt": "hello there", "completion": " i am fine thank you"},
    {"prompt": "the cat", "completion": " sat on the mat"},
    {"prompt": "the cat sat", "completion": " on the mat"},
    {"prompt": "blue", "completion": " is a colour"},
]
# SFTConfig settings of each data layout TRL collates differently
LAYOUTS = {
    "completion-only": {},
    "padding-free": {"padding_free": True, "max_length": None},
    "packed": {"packing": True, "max_length": 64},
}


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("llama")
    save_tiny_llama(folder, SENTENCES)
    return folder


@pytest.fixture
def make_sft(llama: Path, tmp_path: Path) -> Callable[..., Any]:
    """``make_sft(cls, layout)``: an SFTTrainer (or the guarded one) on the tiny Llama, fp32 on
    the CPU, ready for direct ``training_step`` calls."""
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import SFTConfig

    def make(cls: type, layout: str, **overrides: Any) -> Any:
        settings: dict[str, Any] = dict(
            output_dir=str(tmp_path / cls.__name__),
            per_device_train_batch_size=len(ROWS),
            gradient_accumulation_steps=2,
            optim="sgd",
            use_cpu=True,
            bf16=False,
            report_to="none",
            disable_tqdm=True,
            save_strategy="no",
        )
        args = SFTConfig(**(settings | LAYOUTS[layout] | overrides))
        torch.manual_seed(0)
        trainer = cls(
            model=str(llama),
            args=args,
            train_dataset=Dataset.from_list(ROWS),
            processing_class=AutoTokenizer.from_pretrained(llama),
        )
        # set by the training loop before it calls training_step
        trainer.current_gradient_accumulation_steps = args.gradient_accumulation_steps
        return trainer

    return make


def first_batch(trainer: Any) -> dict[str, Any]:
    return dict(next(iter(trainer.get_train_dataloader())))


def tokens_per_forward(model: torch.nn.Module) -> list[int]:
    """The tokens of every forward the model runs, in order."""
    seen: list[int] = []

    def hook(module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        seen.append(int(kwargs["input_ids"].numel()))

    model.register_forward_pre_hook(hook, with_kwargs=True)
    return seen


def step_items(batch: dict[str, Any], more: int) -> torch.Tensor:
    """num_items_in_batch as the Trainer counts it: the shifted targets of this micro-batch and
    ``more`` in the step's other one."""
    return torch.tensor(int(batch["labels"][..., 1:].ne(-100).sum()) + more)


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_chunks_give_the_stock_gradient(
    make_sft: Callable[..., Any],
    layout: str,
    gradients: Callable,
    assert_same_gradients: Callable,
) -> None:
    from trl import SFTTrainer

    stock = make_sft(SFTTrainer, layout)
    batch = first_batch(stock)
    if layout == "completion-only":
        # TRL's completion-only loss: the prompts' tokens are -100, and rows are padded
        assert "attention_mask" in batch and batch["labels"][:, 0].eq(-100).all()
    else:
        # one row of sequences laid end to end, told apart by their position ids
        assert "attention_mask" not in batch and batch["input_ids"].shape[0] == 1
    items = step_items(batch, 17)
    expected = float(stock.training_step(stock.model, dict(batch), items))

    guarded = make_sft(GuardedSFTTrainer, layout)
    forwards = tokens_per_forward(guarded.model)
    guarded.guard_micro_batch_size = 4
    loss = guarded.training_step(guarded.model, dict(batch), items)
    # TRL's loss is Σ token losses ÷ num_items_in_batch: the chunks add up unweighted
    assert guarded._guard_items_normalised is True
    chunks = forwards[2:]  # after the probe's two forwards of one row (sequence)
    assert len(chunks) == 2 and sum(chunks) == batch["input_ids"].numel()
    assert_same_gradients(gradients(stock.model), gradients(guarded.model))
    assert float(loss) == pytest.approx(expected, rel=1e-5)
    # TRL's logged metrics: one entry per call, the tokens counted once, none from the probe
    train, stock_train = guarded._metrics["train"], stock._metrics["train"]
    assert guarded._total_train_tokens == stock._total_train_tokens
    for key in ("entropy", "mean_token_accuracy"):
        assert train[key] == pytest.approx(stock_train[key], rel=1e-5)
    assert not guarded._metrics["eval"]


def test_a_padding_free_batch_is_cut_at_sequence_boundaries(make_sft: Callable[..., Any]) -> None:
    guarded = make_sft(GuardedSFTTrainer, "padding-free")
    batch = first_batch(guarded)
    starts = batch["position_ids"][0].eq(0).nonzero().flatten().tolist()
    assert guarded._guard_rows(batch) == len(starts) == len(ROWS)
    chunks = guarded._guard_split(batch, 4)
    assert [int(c["cu_seq_lens_q"][-1]) for c in chunks] == [
        starts[4],
        batch["input_ids"].shape[1] - starts[4],
    ]
    for chunk in chunks:
        bounds = chunk["cu_seq_lens_q"].tolist()
        # the chunk's own boundaries, from 0, where its position ids restart
        assert chunk["position_ids"][0].eq(0).nonzero().flatten().tolist() == bounds[:-1]
        assert chunk["max_length_q"] == max(b - a for a, b in itertools.pairwise(bounds))
        assert int(chunk["seq_idx"][0, 0]) == 0
        assert chunk["labels"][0, 0] == -100  # no target crosses a cut
    joined = torch.cat([c["input_ids"] for c in chunks], dim=1)
    assert torch.equal(joined, batch["input_ids"])


class FakeOom:
    """A CUDA-style OOM from the backward of the first decoder layer when the forward holds
    more than ``above`` tokens (after the later layers' gradients were written)."""

    def __init__(self, model: Any, above: int) -> None:
        self.above = above
        self.armed = True
        self.raised = 0
        layer = model.get_decoder().layers[0] if hasattr(model, "get_decoder") else None
        assert layer is not None
        layer.register_forward_hook(self._forward)

    def _forward(self, module: Any, args: Any, output: Any) -> None:
        hidden = output[0] if isinstance(output, tuple) else output
        if self.armed and hidden.requires_grad and hidden.shape[:2].numel() > self.above:
            hidden.register_hook(self._backward)

    def _backward(self, grad: torch.Tensor) -> None:
        self.raised += 1
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB.")


@pytest.mark.slow
def test_an_oom_in_the_second_micro_batch_reruns_the_step_to_the_same_gradient_and_metrics(
    make_sft: Callable[..., Any], gradients: Callable, assert_same_gradients: Callable
) -> None:
    from trl import SFTTrainer

    rows = len(ROWS) // 2  # two micro-batches of 3 rows
    stock = make_sft(SFTTrainer, "completion-only", per_device_train_batch_size=rows)
    loader = iter(stock.get_train_dataloader())
    first, second = dict(next(loader)), dict(next(loader))
    items = torch.tensor(sum(int(b["labels"][:, 1:].ne(-100).sum()) for b in (first, second)))
    expected = [float(stock.training_step(stock.model, dict(b), items)) for b in (first, second)]

    guarded = make_sft(GuardedSFTTrainer, "completion-only", per_device_train_batch_size=rows)
    # out of memory only for a whole micro-batch (the probe runs under no_grad: not caught)
    oom = FakeOom(guarded.model, above=second["input_ids"].numel() - 1)
    oom.armed = False
    losses = [float(guarded.training_step(guarded.model, dict(first), items))]
    oom.armed = True  # the step's second micro-batch runs out of memory in its backward
    losses.append(float(guarded.training_step(guarded.model, dict(second), items)))
    assert oom.raised == 1
    assert [e["type"] for e in guarded.guard_events] == ["oom", "backoff"]
    assert guarded.guard_micro_batch_size == 1
    assert_same_gradients(gradients(stock.model), gradients(guarded.model))
    assert losses == pytest.approx(expected, rel=1e-5)
    # the failed attempt's tokens and means are gone: two entries, as a run without OOM logs
    assert guarded._total_train_tokens == stock._total_train_tokens
    for key in ("entropy", "mean_token_accuracy"):
        values = guarded._metrics["train"][key]
        assert values == pytest.approx(stock._metrics["train"][key], rel=1e-5)


class Offload:
    """A stand-in for TRL's activation offloading context: counts entries and nesting."""

    def __init__(self) -> None:
        self.entered = 0
        self.depth = 0
        self.deepest = 0

    @contextlib.contextmanager
    def _inside(self) -> Iterator[None]:
        self.entered += 1
        self.depth += 1
        self.deepest = max(self.deepest, self.depth)
        try:
            yield
        finally:
            self.depth -= 1

    def __enter__(self) -> None:
        self._context = self._inside()
        self._context.__enter__()

    def __exit__(self, *exc: Any) -> None:
        self._context.__exit__(*exc)


def test_trls_offloading_context_wraps_each_chunk_once(make_sft: Callable[..., Any]) -> None:
    guarded = make_sft(GuardedSFTTrainer, "completion-only")
    offload = Offload()
    guarded.maybe_activation_offload_context = offload
    batch = first_batch(guarded)
    guarded.guard_micro_batch_size = 2
    guarded.training_step(guarded.model, batch, step_items(batch, 0))
    assert (offload.entered, offload.deepest) == (len(ROWS) // 2, 1)


def test_padding_free_eval_chunks_join_their_logits_along_the_tokens(
    make_sft: Callable[..., Any],
) -> None:
    from trl import SFTTrainer

    guarded = make_sft(GuardedSFTTrainer, "padding-free")
    batch = first_batch(guarded)
    guarded.model.eval()
    expected = SFTTrainer.prediction_step(guarded, guarded.model, dict(batch), False)
    loss, logits, labels = guarded._guard_predict_chunks(guarded.model, batch, 4, False, None)
    assert logits.shape == expected[1].shape and torch.equal(labels, expected[2])
    assert torch.allclose(logits, expected[1], atol=1e-5)
    assert float(loss) == pytest.approx(float(expected[0]), rel=1e-5)
