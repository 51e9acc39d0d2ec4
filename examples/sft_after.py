"""An SFT script with TRL: a tiny Llama taught to answer sums, LoRA, completion-only loss.

    python examples/sft_before.py --output-dir runs/sft-before   # TRL's SFTTrainer
    python examples/sft_after.py --output-dir runs/sft-after     # under memfit's OOM guard
    MEMFIT_MEMORY_CAP=14MiB python examples/sft_after.py         # under a simulated memory cap

The two files differ in one line, the import of SFTTrainer. By default the model is a tiny
Llama (2 layers, 128 wide, random weights, a word-level tokenizer) built from a config in
memory; its config and tokenizer are written to OUTPUT_DIR/tiny-llama. ``--model PATH`` trains
a causal LM of yours instead (a folder, or a Hub id in the local cache). The rows are
prompt/completion pairs, so TRL's loss counts the completion's tokens only; LoRA adapters
(rank 8, dropout 0) are trained and saved to OUTPUT_DIR/model.

sft_after.py under MEMFIT_MEMORY_CAP: an out-of-memory error inside a step re-runs the step
at a smaller micro-batch with the same gradient: the optimizer steps and (dropout off) the
adapters are those of a run without OOM; what happened is in OUTPUT_DIR/memfit_events.jsonl.

MEMFIT_MEMORY_CAP=14MiB python examples/sft_after.py: step 1 runs out of memory at 8 rows and
goes on at 4. Measured on the CPU (the cap's own count, ``trainer.guard_cap.peak_bytes``), the
default model's step peaks at 18.07 MiB at 8 rows of 16 tokens and at 9.87 MiB at 4 rows; 14 MiB
lies between. ``memfit estimate OUTPUT_DIR/tiny-llama --task causal-lm --seq-len 16
--batch-size 8 --gradient-accumulation-steps 2 --lora-rank 8 --lora-dropout 0
--gradient-checkpointing --device cpu`` says 3.51 MiB (2.66 MiB at 4 rows): it prices the
standard loss, not the buffer of TRL's chunked log-probabilities (min(tokens, 4096) × 32,768
floats: 16 MiB at 128 tokens), most of this tiny model's step.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

# the one line sft_before.py and sft_after.py differ in, first: peft and TRL import bitsandbytes,
# which logs that an optional kernel package is missing; memfit drops that line once imported
from memfit.integrations import GuardedSFTTrainer as SFTTrainer  # isort: skip

import torch
from datasets import Dataset
from peft import LoraConfig
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    set_seed,
)
from trl import SFTConfig

NUMBERS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
           "eleven", "twelve"]  # fmt: skip
SPECIALS = ["<unk>", "<s>", "</s>", "<pad>"]


def rows() -> list[dict[str, str]]:
    """32 prompt/completion rows of one length each (every word one token of the tokenizer)."""
    pairs = [(a, b) for a in range(1, 7) for b in range(1, 7)][:32]
    return [
        {
            "prompt": f"question : what is {NUMBERS[a]} plus {NUMBERS[b]} ? answer :",
            "completion": f" {NUMBERS[a]} plus {NUMBERS[b]} is {NUMBERS[a + b]}",
        }
        for a, b in pairs
    ]


def tiny_llama(folder: Path) -> tuple[Any, Any]:
    """A 2-layer Llama with random weights (seeded) and a word-level tokenizer that knows the
    rows' words; the config and the tokenizer are saved in ``folder``."""
    words = sorted({w for row in rows() for text in row.values() for w in text.split()})
    vocab = {token: i for i, token in enumerate(SPECIALS + words)}
    word_level = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    word_level.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    word_level.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", vocab["<s>"])]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=word_level,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
    )
    config = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=128,
        intermediate_size=344,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
        bos_token_id=vocab["<s>"],
        eos_token_id=vocab["</s>"],
        pad_token_id=vocab["<pad>"],
    )
    folder.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return LlamaForCausalLM(config), tokenizer


def main(argv: list[str] | None = None) -> SFTTrainer:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a causal LM's folder or Hub id (default: a tiny Llama)")
    parser.add_argument("--output-dir", default="runs/sft-example")
    parser.add_argument("--max-steps", type=int, default=2)
    options = parser.parse_args(argv)

    set_seed(0)  # before the model is made: its weights and the adapters start from the seed
    if options.model is None:
        model, tokenizer = tiny_llama(Path(options.output_dir) / "tiny-llama")
    else:
        tokenizer = AutoTokenizer.from_pretrained(options.model)
        model = AutoModelForCausalLM.from_pretrained(options.model)
    gpu = torch.cuda.is_available()
    args = SFTConfig(
        output_dir=options.output_dir,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=2,
        max_steps=options.max_steps,
        learning_rate=1e-3,
        max_length=64,
        use_cpu=not gpu,
        bf16=gpu,  # on the CPU: fp32
        seed=0,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
    )
    lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, task_type="CAUSAL_LM")
    trainer = SFTTrainer(
        model=model,
        args=args,
        train_dataset=Dataset.from_list(rows()),
        processing_class=tokenizer,
        peft_config=lora,
    )
    trainer.train()
    trainer.save_model(f"{options.output_dir}/model")
    print(
        f"trained: {trainer.state.global_step} optimizer steps of "
        f"{args.per_device_train_batch_size} rows × {args.gradient_accumulation_steps} "
        f"micro-batches; the adapters are in {options.output_dir}/model"
    )
    return trainer


if __name__ == "__main__":
    main()
