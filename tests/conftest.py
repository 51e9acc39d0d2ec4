"""Shared fixtures: tiny model folders built from configs (no download, no weights needed)."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from ranks_group import guard_launches, make_scheduler, order_for_workers, running
from tiny_models import gpt2_config, save_bert_tokenizer

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# nothing traced ahead in a background worker (tests that test it turn it on themselves)
os.environ.setdefault("MEMFIT_NO_BACKGROUND", "1")
# traces cached on disk go to one fresh folder per test session, shared by the pytest-xdist
# workers (they inherit this process's environment) and the subprocesses the tests start: a model
# one test traced is not traced again by another (cache files are written whole: os.replace)
# (and so do the datasets cache of the runs that train in a test's process: not the user's)
for _variable, _prefix in (
    ("MEMFIT_CACHE_DIR", "memfit-cache-"),
    ("HF_DATASETS_CACHE", "hf-data-"),
):
    if _variable not in os.environ:
        os.environ[_variable] = tempfile.mkdtemp(prefix=_prefix)
        atexit.register(shutil.rmtree, os.environ[_variable], ignore_errors=True)


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist every core already runs a test process: each of them, and every process
    a test starts, computes on one thread. Several threads per process on a core each would be
    oversubscribed (OpenMP's spinning threads slowed some tests 6-fold). And a test outside the
    ranks group that starts torchrun fails (:func:`ranks_group.guard_launches`)."""
    guard_launches()
    workers = getattr(config.option, "numprocesses", None) or 0
    if isinstance(workers, int) and workers > 1 and "PYTEST_XDIST_WORKER" not in os.environ:
        for variable in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ.setdefault(variable, "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The modules that start several ranks first (one unit of work: :mod:`ranks_group`)."""
    order_for_workers(items)


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook (a plain run has no workers)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Under pytest-xdist, a test module is one unit of work, and every module that starts
    several ranks belongs to one unit, run by one worker: see :mod:`ranks_group`."""
    return make_scheduler(config, log)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    """The test running (its fixtures' setup and teardown included), for the safety net under
    the module scan (:func:`ranks_group.guard_launches`)."""
    with running(item):
        yield


@pytest.fixture(scope="session")
def bert_tokenizer() -> Callable[[Path, Sequence[str]], Any]:
    """:func:`tiny_models.save_bert_tokenizer`, as a fixture."""
    return save_bert_tokenizer


def _save(config, path: Path) -> str:
    config.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_bert(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A 2-layer BERT-shaped config folder."""
    from transformers import BertConfig

    config = BertConfig(
        vocab_size=1000,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=128,
    )
    return _save(config, tmp_path_factory.mktemp("tiny-bert"))


@pytest.fixture(scope="session")
def tiny_gpt2(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A 2-layer GPT-2-shaped config folder with a large-ish vocabulary (the logits dominate)."""
    from transformers import GPT2Config

    config = GPT2Config(vocab_size=5000, n_embd=64, n_layer=2, n_head=4, n_positions=128)
    return _save(config, tmp_path_factory.mktemp("tiny-gpt2"))


SENTENCES = [
    "the cat sat on the mat",
    "the dog ran in the park",
    "a good movie with great acting",
    "an awful film with a bad plot",
    "how do i reset my password",
    "steps to update your phone",
]


@pytest.fixture(scope="session")
def gpt2_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A 2-layer GPT-2 (random weights, dropout off) with a byte-level BPE trained in memory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GPT2LMHeadModel, GPT2TokenizerFast

    folder = tmp_path_factory.mktemp("gpt2")
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(SENTENCES * 3, trainer=trainer)
    tokenizer = GPT2TokenizerFast(
        tokenizer_object=bpe, eos_token="<|endoftext|>", bos_token="<|endoftext|>"
    )
    config = gpt2_config(
        len(tokenizer), bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id
    )
    GPT2LMHeadModel(config).save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    from transformers import AutoTokenizer

    # the BPE knows the sentences: no unknown pieces, and the text comes back whole
    reloaded = AutoTokenizer.from_pretrained(folder)
    ids = reloaded(SENTENCES[0])["input_ids"]
    assert len(ids) < len(SENTENCES[0]) and reloaded.decode(ids) == SENTENCES[0], ids
    return str(folder)
