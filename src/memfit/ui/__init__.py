"""``memfit ui``: the estimate and the plan on a page (Gradio), answered by the CLI's estimator and
planner.

:mod:`memfit.ui.job` is the page's job (its knobs, its link, its CLI lines), :mod:`memfit.ui.answers`
what the page shows (the verdict, the breakdown, the curves, the plan), both without Gradio;
:mod:`memfit.ui.app` is the page itself, the only module that imports Gradio (the ``ui`` extra).
Nothing here is imported by ``import memfit``.
"""
