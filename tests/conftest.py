"""Shared fixtures: tiny model folders built from configs (no download, no weights needed)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# traces cached on disk go to a fresh folder per test session
os.environ.setdefault("MEMFIT_CACHE_DIR", tempfile.mkdtemp(prefix="memfit-cache-"))


SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def save_bert_tokenizer(folder: Path, words: Sequence[str]) -> Any:
    """A BERT WordPiece tokenizer that knows ``words`` (ids 5, 6, … after the 5 specials), saved
    in ``folder`` and read back with AutoTokenizer; checked: a sentence of the words encodes to
    their ids. (``BertTokenizerFast(vocab_file=...)`` ignores the file under transformers 5: every
    word would be [UNK].)"""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import AutoTokenizer, BertTokenizerFast

    vocab = {token: i for i, token in enumerate([*SPECIALS, *words])}
    wordpiece = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    wordpiece.normalizer = normalizers.BertNormalizer(lowercase=True)
    wordpiece.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    wordpiece.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])],
    )
    wordpiece.decoder = decoders.WordPiece()
    (folder / "vocab.txt").write_text("\n".join(vocab) + "\n")
    BertTokenizerFast(
        tokenizer_object=wordpiece,
        unk_token="[UNK]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
    ).save_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert len(tokenizer) == len(vocab), (len(tokenizer), len(vocab))
    sample = list(words)[:8]
    ids = tokenizer(" ".join(sample))["input_ids"]
    assert ids == [vocab["[CLS]"], *(vocab[w] for w in sample), vocab["[SEP]"]], ids
    return tokenizer


@pytest.fixture(scope="session")
def bert_tokenizer() -> Callable[[Path, Sequence[str]], Any]:
    """:func:`save_bert_tokenizer`, for test modules (a conftest is not imported by name)."""
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
    from transformers import GPT2Config, GPT2LMHeadModel, GPT2TokenizerFast

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
    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_embd=32,
        n_layer=2,
        n_head=2,
        n_positions=64,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    GPT2LMHeadModel(config).save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    from transformers import AutoTokenizer

    # the BPE knows the sentences: no unknown pieces, and the text comes back whole
    reloaded = AutoTokenizer.from_pretrained(folder)
    ids = reloaded(SENTENCES[0])["input_ids"]
    assert len(ids) < len(SENTENCES[0]) and reloaded.decode(ids) == SENTENCES[0], ids
    return str(folder)
