"""``python -m memfit``."""

from memfit.cli import main

main()
