"""The tiny models the tests build offline (no download, random weights): one place for their
configs, so every test's BERT, GPT-2 and sentence-transformers folder is built the same way.

Test modules import it by name (``from tiny_models import …``): pytest puts ``tests/`` on the
path for ``tests/conftest.py``, as it puts ``tests/e2e/`` there for ``memfit_runs``. The WordPiece
tokenizer comes from ``bench/_tiny.py`` (``bench`` is on pytest's ``pythonpath``), the one copy
the benches use too.

A builder never seeds unless asked (``seed``): a test that builds several models under one seed
gets the same weights as before, model after model.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from _tiny import SPECIALS, save_bert_tokenizer

__all__ = [
    "CHAT_TEMPLATE",
    "LLAMA_SPECIALS",
    "SPECIALS",
    "bert_config",
    "gpt2_config",
    "save_bert",
    "save_bert_tokenizer",
    "save_sentence_transformer",
    "save_tiny_llama",
]


def bert_config(
    vocab_size: int, *, layers: int = 2, positions: int = 64, dropout: bool = False, **extra: Any
) -> Any:
    """A BERT config 32 wide (2 heads, intermediate 64); dropout off unless ``dropout``;
    ``extra`` sets any other field (``num_labels``, or a wider ``hidden_size``)."""
    from transformers import BertConfig

    values: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=32,
        num_hidden_layers=layers,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=positions,
    )
    if not dropout:
        values.update(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    values.update(extra)
    return BertConfig(**values)


def gpt2_config(vocab_size: int, *, positions: int = 64, **extra: Any) -> Any:
    """A 2-layer GPT-2 config 32 wide (2 heads), dropout off; ``extra`` sets token ids."""
    from transformers import GPT2Config

    return GPT2Config(
        vocab_size=vocab_size,
        n_embd=32,
        n_layer=2,
        n_head=2,
        n_positions=positions,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        **extra,
    )


def save_bert(
    folder: Path,
    words: Sequence[str],
    *,
    num_labels: int | None = None,
    seed: int | None = 0,
    **config: Any,
) -> Any:
    """A BERT saved in ``folder`` with a WordPiece tokenizer that knows ``words``: a
    ``BertModel``, or a ``BertForSequenceClassification`` of ``num_labels``; weights drawn after
    ``torch.manual_seed(seed)`` (``None``: from the generator as it is); ``config`` goes to
    :func:`bert_config`. Returns the tokenizer."""
    import torch
    from transformers import BertForSequenceClassification, BertModel

    tokenizer = save_bert_tokenizer(folder, words)
    if num_labels is not None:
        config["num_labels"] = num_labels
    settings = bert_config(len(tokenizer), **config)
    if seed is not None:
        torch.manual_seed(seed)
    model = (BertModel if num_labels is None else BertForSequenceClassification)(settings)
    model.save_pretrained(folder)  # safetensors: the only format transformers 5 writes
    return tokenizer


def save_sentence_transformer(folder: Path, encoder: Path, *, max_seq_length: int) -> None:
    """A sentence-transformers folder: the HF model in ``encoder`` with mean pooling."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling

    transformer = Transformer(str(encoder), max_seq_length=max_seq_length)
    pooling = Pooling(transformer.get_embedding_dimension(), "mean")
    SentenceTransformer(modules=[transformer, pooling], device="cpu").save(str(folder))


# a chat template in the shape of Llama's and ChatML's: the reply and its end-of-turn are the
# assistant's tokens ({% generation %} … {% endgeneration %}); the header is the prompt's
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}<|assistant|>\n"
    "{% generation %}{{ message['content'] }}<|end|>\n{% endgeneration %}"
    "{% else %}<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
LLAMA_SPECIALS = ["<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]


def save_tiny_llama(
    folder: Path,
    sentences: Sequence[str],
    *,
    chat_template: str | None = CHAT_TEMPLATE,
    positions: int = 128,
    seed: int | None = 0,
) -> Any:
    """A 2-layer Llama (32 wide, 4 heads over 2 key/value heads, random weights after
    ``torch.manual_seed(seed)``) saved in ``folder`` with a byte-level BPE trained on
    ``sentences``: BOS added to every text (as Llama's tokenizer does), EOS ``</s>``, pad
    ``<pad>``, the chat tokens of :data:`LLAMA_SPECIALS` and ``chat_template`` (None: no
    template). Returns the tokenizer read back."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=LLAMA_SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(list(sentences) * 3, trainer=trainer)
    bos = bpe.token_to_id("<s>")
    bpe.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", bos)]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(folder)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=positions,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    if seed is not None:
        torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(folder)
    return AutoTokenizer.from_pretrained(folder)


# the words of the tiny Llama's vocabulary in the instruction and packing tests (save_tiny_llama
# builds its tokenizer from them), and their rows' files
SENTENCES = [
    "what is two plus two",
    "it is four",
    "the cat sat on the mat",
    "name a colour",
    "blue is a colour",
    "hello there how are you",
    "i am fine thank you",
]


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    """``rows`` as a JSON-lines file at ``path``."""
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path
