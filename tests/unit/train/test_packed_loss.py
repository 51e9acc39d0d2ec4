"""Padding-free packing (``--packing``, strategy ``bfd``) in the causal-lm recipe: a packed step
has the loss and the gradients of the same rows unpacked (fp32, CPU, SDPA and eager attention)
for plain text, prompt/completion and chat rows; the guard's split of a packed step has the
whole step's gradient; instruction rows pack with bfd and are refused in wrapped blocks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from memfit.data.rows import LENGTH, DataOptions
from memfit.errors import UsageError
from memfit.train.config import TrainConfig, config_problems
from memfit.train.recipes import CausalLMRecipe
from memfit.train.recipes.causal_lm import SEGMENTS, TARGETS, TOKENS
from tiny_models import SENTENCES, save_tiny_llama, write_jsonl

# the last text is longer than the text budget (24 tokens): truncated as an unpacked row is
TEXTS = [
    {"text": t}
    for t in [
        *SENTENCES,
        "the cat",
        "blue",
        "what is two plus two it is four",
        "the cat sat on the mat " * 5,
    ]
]
PAIRS = [
    {"prompt": "what is two plus two", "completion": " it is four"},
    {"prompt": "name a colour", "completion": " blue"},
    {"prompt": "the cat", "completion": " sat on the mat"},
    {"prompt": "hello there how are you", "completion": " i am fine thank you"},
    {"prompt": "what is", "completion": " two"},
    {"prompt": "blue is a", "completion": " colour"},
]
CHATS = [
    {
        "messages": [
            {"role": "user", "content": "what is two plus two"},
            {"role": "assistant", "content": "it is four"},
        ]
    },
    {
        "messages": [
            {"role": "system", "content": "be kind"},
            {"role": "user", "content": "name a colour"},
            {"role": "assistant", "content": "blue"},
            {"role": "user", "content": "hello there how are you"},
            {"role": "assistant", "content": "i am fine thank you"},
        ]
    },
    {
        "messages": [
            {"role": "user", "content": "the cat"},
            {"role": "assistant", "content": "sat on the mat"},
        ]
    },
    {
        "messages": [
            {"role": "user", "content": "name a colour"},
            {"role": "assistant", "content": "blue"},
        ]
    },
]
# each kind's rows and a budget that packs several rows into a sequence and leaves some
# sequences short of it
KINDS = {
    "text": (TEXTS, {}, 24),
    "prompt-completion": (
        PAIRS,
        {"prompt_column": "prompt", "completion_column": "completion"},
        24,
    ),
    "chat": (CHATS, {"messages_column": "messages"}, 64),
}


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    folder = tmp_path_factory.mktemp("llama")
    save_tiny_llama(folder, SENTENCES)
    return str(folder)


def recipe_for(model: str, tmp_path: Path, budget: int, **options: Any) -> CausalLMRecipe:
    recipe = CausalLMRecipe(model, max_seq_len=budget, **options)
    recipe.data_options = DataOptions(cache_dir=str(tmp_path / "cache"))
    return recipe


def gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def loss_and_gradients(recipe: CausalLMRecipe, rows: Any) -> tuple[float, dict[str, torch.Tensor]]:
    recipe.model.zero_grad(set_to_none=True)
    loss = recipe.loss(list(rows), recipe.units(list(rows)))
    loss.backward()
    return float(loss.detach()), gradients(recipe.model)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_a_packed_step_has_the_loss_and_gradients_of_its_rows_unpacked(
    llama_dir: str, tmp_path: Path, kind: str, attention: str
) -> None:
    data, columns, budget = KINDS[kind]
    train = write_jsonl(tmp_path / "train.jsonl", data)
    plain = recipe_for(llama_dir, tmp_path, budget, attn_implementation=attention, **columns)
    rows = plain.read(train)
    plain.build(rows)
    plain.model.eval()  # no dropout: the two steps must see the same function
    packed = recipe_for(
        llama_dir, tmp_path, budget, attn_implementation=attention, packing=True, **columns
    )
    assert packed.packing == "bfd"  # the default strategy
    sequences = packed.read(train)
    packed.model, packed.tokenizer = plain.model, plain.tokenizer
    # the packing is real: fewer sequences than rows, some holding several rows, the batch's
    # shorter sequences padded after their rows
    segments = [list(s[SEGMENTS]) for s in sequences]
    assert sum(len(s) for s in segments) == len(rows) > len(sequences)
    assert max(len(s) for s in segments) >= 2
    assert len({sum(s) for s in segments}) > 1 and all(sum(s) <= budget for s in segments)
    # the same tokens (rows past the budget truncated as unpacked rows are), the same targets
    assert sorted(t for s in sequences for t in s[TOKENS]) == sorted(
        t for r in rows for t in plain._tokens(r)[0]
    )
    assert packed.units(sequences) == plain.units(rows)

    _, attention_mask, _, positions = packed._batch(list(sequences))
    assert attention_mask is None and positions is not None
    # a sequence of several rows: each row's positions start over
    k = next(i for i, s in enumerate(segments) if len(s) >= 2)
    first = segments[k][0]
    assert positions[k, : first + 2].tolist() == [*range(first), 0, 1]

    expected_loss, expected = loss_and_gradients(plain, rows)
    loss, got = loss_and_gradients(packed, sequences)
    assert loss == pytest.approx(expected_loss, rel=1e-5, abs=1e-6)
    assert got.keys() == expected.keys() and got
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], atol=1e-5, rtol=1e-5, msg=name)
    # the eval pass too: the summed loss and the target tokens
    with torch.no_grad():
        summed, tokens = packed.eval_partial(list(sequences))
        plain_summed, plain_tokens = plain.eval_partial(list(rows))
    assert tokens == plain_tokens and summed == pytest.approx(plain_summed, rel=1e-5)


def test_the_guard_splits_a_packed_step_with_the_whole_steps_gradient(
    llama_dir: str, tmp_path: Path
) -> None:
    from memfit.guard import Guard

    data, columns, budget = KINDS["prompt-completion"]
    train = write_jsonl(tmp_path / "train.jsonl", data)
    recipe = recipe_for(llama_dir, tmp_path, budget, packing=True, **columns)
    sequences = list(recipe.read(train))
    recipe.build(sequences)
    recipe.model.eval()
    assert len(sequences) >= 2
    # the sequences hold different numbers of targets: a per-sequence weight would fail
    counts = [recipe.units([s]) for s in sequences]
    assert len(set(counts)) > 1
    _, whole = loss_and_gradients(recipe, sequences)
    recipe.model.zero_grad(set_to_none=True)
    params = [p for p in recipe.model.parameters() if p.requires_grad]
    Guard(micro_batch_size=1).step(sequences, recipe, params=params)
    split = gradients(recipe.model)
    for name in whole:
        torch.testing.assert_close(split[name], whole[name], atol=1e-6, rtol=1e-5, msg=name)


def test_packed_targets_leave_each_rows_first_token_out(llama_dir: str, tmp_path: Path) -> None:
    data, columns, budget = KINDS["text"]
    train = write_jsonl(tmp_path / "train.jsonl", data)
    recipe = recipe_for(llama_dir, tmp_path, budget, packing=True, **columns)
    for sequence in recipe.read(train):
        starts = [sum(sequence[SEGMENTS][:k]) for k in range(len(sequence[SEGMENTS]))]
        assert [sequence[TARGETS][s] for s in starts] == [0] * len(starts)
        assert sum(sequence[TARGETS]) == sum(n - 1 for n in sequence[SEGMENTS])


def test_instruction_rows_pack_with_bfd_and_are_refused_in_wrapped_blocks(tmp_path: Path) -> None:
    recipe = CausalLMRecipe("m", prompt_column="p", completion_column="c", packing=True)
    assert recipe.packing == "bfd"
    with pytest.raises(UsageError, match=r"^--packing-strategy wrapped: not with --prompt-column"):
        CausalLMRecipe(
            "m", prompt_column="p", completion_column="c", packing=True, packing_strategy="wrapped"
        )
    train = write_jsonl(tmp_path / "t.jsonl", PAIRS)
    base = {
        "task": "causal-lm",
        "model": "m",
        "train_file": str(train),
        "output_dir": str(tmp_path / "out"),
        "messages_column": "messages",
        "packing": True,
    }
    assert not [p for p in config_problems(TrainConfig(**base)) if "packing" in p]
    wrapped = [
        p
        for p in config_problems(TrainConfig(**base, packing_strategy="wrapped"))
        if "packing" in p
    ]
    assert wrapped == [
        "--packing-strategy wrapped: not with --messages-column (its blocks cut rows and their "
        "loss masks across blocks); use --packing-strategy bfd, which packs whole rows"
    ]
    # a strategy without packing, or packing for another task, says so
    no_packing = TrainConfig(**{**base, "packing": False}, packing_strategy="bfd")
    assert "--packing-strategy: only with --packing" in config_problems(no_packing)


def test_memfit_train_refuses_wrapped_instruction_rows_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from memfit.cli import main

    train = write_jsonl(tmp_path / "t.jsonl", PAIRS)
    argv = [
        "train", "--task", "causal-lm", "--model", str(tmp_path), "--train-file", str(train),
        "--output-dir", str(tmp_path / "out"), "--device", "cpu", "--prompt-column", "prompt",
        "--completion-column", "completion", "--packing", "--packing-strategy", "wrapped",
    ]  # fmt: skip
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert [x for x in err.splitlines() if x.startswith("memfit:")] == [
        "memfit: error: --packing-strategy wrapped: not with --prompt-column/--completion-column "
        "(its blocks cut rows and their loss masks across blocks); use --packing-strategy bfd, "
        "which packs whole rows"
    ]
    assert not (tmp_path / "out").exists()


def test_a_flattened_micro_batch_has_the_loss_of_its_rows_unpacked(
    llama_dir: str, tmp_path: Path
) -> None:
    """Flash attention's variable-length path reads the rows' boundaries from the positions of
    a single row: with it the recipe feeds a micro-batch as one flattened row without padding.
    transformers reads the same positions on SDPA, so the flattening is checked on the CPU."""
    data, columns, budget = KINDS["chat"]
    train = write_jsonl(tmp_path / "train.jsonl", data)
    plain = recipe_for(llama_dir, tmp_path, budget, **columns)
    rows = plain.read(train)
    plain.build(rows)
    plain.model.eval()
    packed = recipe_for(llama_dir, tmp_path, budget, packing=True, **columns)
    sequences = list(packed.read(train))
    packed.model, packed.tokenizer = plain.model, plain.tokenizer
    packed.attn_implementation = "flash_attention_2"  # the batch only: the model runs SDPA
    input_ids, attention_mask, labels, positions = packed._batch(sequences)
    assert (
        input_ids.shape == labels.shape == positions.shape == (1, sum(s[LENGTH] for s in sequences))
    )
    assert attention_mask is None and int((positions == 0).sum()) == len(rows)
    expected_loss, expected = loss_and_gradients(plain, rows)
    loss, got = loss_and_gradients(packed, sequences)
    assert loss == pytest.approx(expected_loss, rel=1e-5, abs=1e-6)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], atol=1e-5, rtol=1e-5, msg=name)


def test_packing_is_a_pure_function_of_the_data(llama_dir: str, tmp_path: Path) -> None:
    data, columns, budget = KINDS["text"]
    train = write_jsonl(tmp_path / "train.jsonl", data)
    first = list(recipe_for(llama_dir, tmp_path, budget, packing=True, **columns).read(train))
    # another recipe, without the tokenized cache: the same sequences, in the same order
    again = CausalLMRecipe(llama_dir, max_seq_len=budget, packing=True)
    again.data_options = DataOptions(cache_dir=str(tmp_path / "other-cache"))
    assert list(again.read(train)) == first
    # the row past the budget fills a sequence of its own, cut to the budget
    assert [budget] in [list(s[SEGMENTS]) for s in first]


def test_gpt2s_learned_positions_restart_in_each_packed_row(gpt2_dir: str, tmp_path: Path) -> None:
    """GPT-2 adds a learned embedding per position: a packed row must read its own positions,
    not the sequence's."""
    train = write_jsonl(tmp_path / "train.jsonl", TEXTS)
    plain = recipe_for(gpt2_dir, tmp_path, 24)
    rows = plain.read(train)
    plain.build(rows)
    plain.model.eval()
    packed = recipe_for(gpt2_dir, tmp_path, 24, packing=True)
    sequences = list(packed.read(train))
    assert max(len(s[SEGMENTS]) for s in sequences) >= 2
    packed.model, packed.tokenizer = plain.model, plain.tokenizer
    expected_loss, expected = loss_and_gradients(plain, rows)
    loss, got = loss_and_gradients(packed, sequences)
    assert loss == pytest.approx(expected_loss, rel=1e-5, abs=1e-6)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], atol=1e-5, rtol=1e-5, msg=name)


def test_a_model_that_cannot_keep_packed_rows_apart_is_refused(llama_dir: str) -> None:
    """A state-space model's state runs on from one packed row into the next: bfd is refused
    for it (one line naming the flag), not trained on rows that see each other."""
    from transformers import AutoModelForCausalLM, MambaConfig, MambaForCausalLM

    from memfit.train.recipes.causal_lm import packing_problem

    config = MambaConfig(vocab_size=32, hidden_size=8, num_hidden_layers=1, state_size=2)
    problem = packing_problem(MambaForCausalLM(config))
    assert problem is not None
    assert problem.startswith("--packing-strategy bfd: MambaForCausalLM does not build its")
    assert packing_problem(AutoModelForCausalLM.from_pretrained(llama_dir)) is None
