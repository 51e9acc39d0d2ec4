"""A tiny BERT WordPiece tokenizer that knows its words, for the benches' model folders.

``BertTokenizerFast(vocab_file=...)`` ignores the file under transformers 5 (every word is
``[UNK]``, so every text of a length is the same input); this builds the WordPiece model with the
``tokenizers`` library, saves it, reads it back with ``AutoTokenizer`` and checks that the words
encode to their ids. The tests use this one too (``tests/tiny_models.py``: ``bench`` is on
pytest's ``pythonpath``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def save_bert_tokenizer(folder: Path, words: Sequence[str]) -> Any:
    """The tokenizer of ``[PAD] [UNK] [CLS] [SEP] [MASK]`` then ``words`` (ids 5, 6, …), saved
    in ``folder`` (with a ``vocab.txt``) and read back; raises if the words do not encode."""
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
    (folder / "vocab.txt").write_text("\n".join(vocab) + "\n", encoding="utf-8")
    BertTokenizerFast(
        tokenizer_object=wordpiece,
        unk_token="[UNK]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
    ).save_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    sample = list(words)[:8]
    ids = tokenizer(" ".join(sample))["input_ids"]
    expected = [vocab["[CLS]"], *(vocab[w] for w in sample), vocab["[SEP]"]]
    if len(tokenizer) != len(vocab) or ids != expected:
        raise RuntimeError(f"the tiny tokenizer does not know its words: {ids} != {expected}")
    return tokenizer


WORD_SPECIALS = ["<pad>", "<unk>", "<s>", "</s>"]


def save_word_tokenizer(folder: Path, words: Sequence[str]) -> Any:
    """A word-level tokenizer for a causal LM: ``<pad> <unk> <s> </s>`` then ``words`` (ids 4,
    5, …), split on whitespace, BOS ``<s>`` before every text (as Llama's tokenizer does), EOS
    ``</s>``, pad ``<pad>``; saved in ``folder`` as a ``PreTrainedTokenizerFast`` and read back.
    One word is one token, so a text of N words is N + 1 tokens. Raises if the words do not
    encode to their ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate([*WORD_SPECIALS, *words])}
    wordlevel = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    wordlevel.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    wordlevel.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", vocab["<s>"])]
    )
    PreTrainedTokenizerFast(
        tokenizer_object=wordlevel,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
    ).save_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    sample = list(words)[:8]
    ids = tokenizer(" ".join(sample))["input_ids"]
    expected = [vocab["<s>"], *(vocab[w] for w in sample)]
    if len(tokenizer) != len(vocab) or ids != expected:
        raise RuntimeError(f"the word tokenizer does not know its words: {ids} != {expected}")
    return tokenizer
