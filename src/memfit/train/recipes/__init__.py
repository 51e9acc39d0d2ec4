"""The training recipes of ``memfit train``, one readable file per task (interface in ``base``)."""

from __future__ import annotations

from typing import Any

from memfit.errors import UsageError
from memfit.train.recipes.base import Recipe, Row
from memfit.train.recipes.causal_lm import CausalLMRecipe
from memfit.train.recipes.classification import ClassificationRecipe
from memfit.train.recipes.sentence_embedding import SentenceEmbeddingRecipe

# --task value -> recipe; the CLI's choices and the loop's lookup both read this
RECIPES: dict[str, type[Recipe]] = {
    ClassificationRecipe.task: ClassificationRecipe,
    CausalLMRecipe.task: CausalLMRecipe,
    SentenceEmbeddingRecipe.task: SentenceEmbeddingRecipe,
}


def make_recipe(task: str, **options: Any) -> Recipe:
    """The recipe for ``task`` (``--task``), built with its keyword options (model first)."""
    if task not in RECIPES:
        raise UsageError(f"--task: unknown value {task!r}; one of {', '.join(RECIPES)}")
    return RECIPES[task](**options)


def recipe_for(cfg: Any) -> Recipe:
    """The recipe of a run's settings (a :class:`memfit.train.TrainConfig`): its task's recipe,
    which picks its own options from them (:meth:`Recipe.from_config`)."""
    if cfg.task not in RECIPES:
        raise UsageError(f"--task: unknown value {cfg.task!r}; one of {', '.join(RECIPES)}")
    return RECIPES[cfg.task].from_config(cfg)


__all__ = [
    "RECIPES",
    "CausalLMRecipe",
    "ClassificationRecipe",
    "Recipe",
    "Row",
    "SentenceEmbeddingRecipe",
    "make_recipe",
    "recipe_for",
]
