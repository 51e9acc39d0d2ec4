"""SageMaker entry point: `memfit train`, with the training job's environment as its settings.

Give this file as the estimator's ``entry_point`` (see README.md beside it). Inside the job,
SageMaker sets ``SM_CHANNEL_TRAIN`` / ``SM_CHANNEL_EVAL`` (the data channels), ``SM_MODEL_DIR``,
``SM_OUTPUT_DATA_DIR`` and the hyperparameters (``SM_HPS``, every value a JSON string); memfit
reads them as the defaults of ``memfit train`` (``memfit.train.sagemaker``). The trained model ends
in ``SM_MODEL_DIR``, the run folder (metrics, events, checkpoints) in ``/opt/ml/checkpoints`` when
the estimator sets ``checkpoint_s3_uri``, else in ``SM_OUTPUT_DATA_DIR``.

A ``run.yaml`` beside this file (``memfit plan --write-config run.yaml``) is used as the run
config; hyperparameters fill what it leaves open.

Try it locally with fake job folders:

    SM_CHANNEL_TRAIN=data/ SM_MODEL_DIR=/tmp/model SM_OUTPUT_DATA_DIR=/tmp/out \
    SM_HPS='{"task": "classification", "model": "./bert-folder", "epochs": "1"}' \
    python examples/sagemaker/train_entry.py
"""

from __future__ import annotations

import sys
from pathlib import Path

from memfit.cli import main

if __name__ == "__main__":
    # SageMaker also passes the hyperparameters as `--name value` arguments, spelled as in the
    # estimator (`--effective_batch_size 32`), which are not memfit's flags: memfit reads them,
    # decoded and checked, from SM_HPS instead, and this command line is left out
    config = Path(__file__).with_name("run.yaml")
    sys.exit(main(["train", *([str(config)] if config.is_file() else [])]))
