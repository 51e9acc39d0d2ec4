"""`memfit train --model FOLDER` (and `memfit predict`/`embed MODEL_DIR`) with a defective model
folder (issue 16): exit 2, exactly one `memfit: error:` line naming the flag and the folder or file
and what is wrong, no traceback, nothing written to --output-dir (or --output).

The defects are made from good tiny folders: an unknown ``model_type``; a ``config.json`` that is
not JSON; an empty folder; a config with no weights (training would start from random weights);
``model.safetensors`` or ``pytorch_model.bin`` cut in half; a ``hidden_size`` changed after saving
(the weights no longer fit the config); no tokenizer files (transformers would fall back to a
5-token vocabulary); ``--max-seq-len`` beyond the position embeddings; a registry name (memfit's
registry holds architecture numbers, not weights). Issue 30: weights that load but leave the
model's body random (one unrelated tensor, a config given 12 layers where 2 were saved), weights
that are an unsafe pickle (never unpickled), a sentence-transformers folder naming a module of
remote code; a new task head (the weights lack it by design) still trains.

The cases run in this process through ``memfit.cli.main`` (the same code as the program: a
``UsageError`` becomes the one line and ``SystemExit(2)``; any other exception would escape as a
traceback); one case also runs as ``python -m memfit`` to pin the real exit code.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from memfit.cli import main

pytestmark = pytest.mark.slow  # end to end: `pytest -m "not slow"` leaves it out

ERROR = "memfit: error: "


# --- the defects ---------------------------------------------------------------------------------
def _config(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())


def _write_config(folder: Path, config: dict) -> None:
    (folder / "config.json").write_text(json.dumps(config))


def _unknown_model_type(folder: Path) -> None:
    _write_config(folder, _config(folder) | {"model_type": "no-such-architecture"})


def _corrupt_config(folder: Path) -> None:
    (folder / "config.json").write_text('{"model_type": "bert", "hidden_size": ')


def _empty(folder: Path) -> None:
    shutil.rmtree(folder)
    folder.mkdir()


def _no_weights(folder: Path) -> None:
    (folder / "model.safetensors").unlink()


def _truncated_safetensors(folder: Path) -> None:
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])


def _truncated_bin(folder: Path) -> None:
    import torch
    from safetensors.torch import load_file

    weights = folder / "model.safetensors"
    torch.save(load_file(weights), folder / "pytorch_model.bin")
    weights.unlink()
    data = (folder / "pytorch_model.bin").read_bytes()
    (folder / "pytorch_model.bin").write_bytes(data[: len(data) // 2])


def _sizes_disagree(folder: Path) -> None:
    config = _config(folder)
    key = "n_embd" if "n_embd" in config else "hidden_size"  # GPT-2 names it n_embd
    _write_config(folder, config | {key: 2 * config[key]})


def _no_tokenizer(folder: Path) -> None:
    for path in folder.iterdir():
        if path.name not in ("config.json", "model.safetensors"):
            path.unlink()


def _one_unrelated_tensor(folder: Path) -> None:
    """Weights that load (a whole safetensors file) but hold nothing of the model's (issue 30)."""
    import torch
    from safetensors.torch import save_file

    save_file({"unrelated.weight": torch.zeros(3)}, folder / "model.safetensors")


def _more_layers(folder: Path) -> None:
    """config.json edited from 2 layers to 12 after the weights were saved (issue 30)."""
    config = _config(folder)
    key = "n_layer" if "n_layer" in config else "num_hidden_layers"  # GPT-2 names it n_layer
    _write_config(folder, config | {key: 12})


class _Planted:
    """Unpickled without torch's safe loader, this makes the folder ``pickle-ran`` beside the
    model folder: the test sees whether it ever was."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.mkdir, (str(self.marker),)


def _unsafe_pickle(folder: Path) -> None:
    """The only weights are a pytorch_model.bin that holds a planted global (issue 30)."""
    import torch
    from safetensors.torch import load_file

    weights = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    torch.save(
        {**weights, "planted": _Planted(folder.parent / "pickle-ran")}, folder / "pytorch_model.bin"
    )


def _custom_module(folder: Path) -> None:
    """A sentence-transformers folder whose modules.json names a class of remote code."""
    modules = json.loads((folder / "modules.json").read_text())
    modules[-1]["type"] = "evil_pkg.modules.Pooling"
    (folder / "modules.json").write_text(json.dumps(modules))


@dataclass
class Case:
    """A `memfit train` run: the good folder it starts from (``classifier``, ``gpt2``), what is
    done to its copy, the flags, and the one error line (a regex; {m}: the model folder)."""

    source: str | None
    defect: Callable[[Path], None] | None
    error: str
    task: str = "classification"
    flags: list[str] = field(default_factory=list)
    model: str | None = None  # instead of the folder (a registry name, a missing path)
    long_row: int = 0  # words in one more row (past the positions: the run would fail there)


CASES: dict[str, Case] = {
    "unknown-model-type": Case(
        "classifier",
        _unknown_model_type,
        r"--model: model config {m}/config\.json has model_type 'no-such-architecture', which "
        r"transformers does not know",
    ),
    "corrupt-config": Case(
        "classifier",
        _corrupt_config,
        r"--model: model config {m}/config\.json is not valid JSON: line 1: ",
    ),
    "empty-folder": Case(
        "classifier", _empty, r"--model: {m} holds no model: no config\.json or modules\.json"
    ),
    "missing-folder": Case(
        None,
        None,
        r"--model: cannot load '{m}': not a local folder and not in the Hugging Face cache",
        model="does-not-exist",
    ),
    "no-weights": Case(
        "classifier",
        _no_weights,
        r"--model: {m} holds no weights \(model\.safetensors or pytorch_model\.bin\): training "
        r"would start from random weights",
    ),
    "truncated-safetensors": Case(
        "classifier",
        _truncated_safetensors,
        r"--model: {m}/model\.safetensors is truncated or corrupt",
    ),
    "truncated-bin": Case(
        "classifier", _truncated_bin, r"--model: {m}/pytorch_model\.bin is truncated or corrupt"
    ),
    "sizes-disagree": Case(
        "classifier",
        _sizes_disagree,
        r"--model: the weights in {m} do not fit its config\.json: \S+ is 32(×\d+)? in the "
        r"weights, 64(×\d+)? by the config",
    ),
    "no-tokenizer": Case(
        "classifier",
        _no_tokenizer,
        r"--model: {m} holds no tokenizer \(no tokenizer\.json, tokenizer_config\.json, "
        r"vocab\.txt",
    ),
    "no-tokenizer-causal-lm": Case(
        "gpt2",
        _no_tokenizer,
        r"--model: {m} holds no tokenizer \(no tokenizer\.json, tokenizer_config\.json, "
        r"vocab\.txt",
        task="causal-lm",
    ),
    "max-seq-len-beyond-positions": Case(
        "classifier",
        None,
        r"--max-seq-len: 1000 is beyond the 256 positions {m} can use; use --max-seq-len 256 "
        r"or less",
        flags=["--max-seq-len", "1000"],
        long_row=400,
    ),
    "max-seq-len-beyond-positions-causal-lm": Case(
        "gpt2",
        None,
        r"--max-seq-len: 100 is beyond the 64 positions {m} can use; use --max-seq-len 64 or less",
        task="causal-lm",
        flags=["--max-seq-len", "100"],
        long_row=120,
    ),
    "registry-name": Case(
        None,
        None,
        r"--model: 'bert-base-uncased' is in memfit's registry of architectures \(for estimate "
        r"and plan\), which holds no weights: memfit train needs a model folder",
        model="bert-base-uncased",
    ),
    # issue 30: weights that leave the model's body random are refused, not trained in silence
    "one-unrelated-tensor": Case(
        "classifier",
        _one_unrelated_tensor,
        r"--model: the weights in {m} do not cover its config\.json: 37 of its 41 tensors are "
        r"missing \(bert\.embeddings\.\S+, bert\.embeddings\.\S+ and 35 more\), and training "
        r"would start them from random weights",
    ),
    "more-layers-in-config": Case(
        "classifier",
        _more_layers,
        r"--model: the weights in {m} do not cover its config\.json: 160 of its \d+ tensors are "
        r"missing \(bert\.encoder\.layer\.2\.\S+, bert\.encoder\.layer\.2\.\S+ and 158 more\)",
    ),
    "more-layers-in-config-causal-lm": Case(
        "gpt2",
        _more_layers,
        r"--model: the weights in {m} do not cover its config\.json: \d+ of its \d+ tensors are "
        r"missing \(transformer\.h\.2\.\S+, transformer\.h\.2\.\S+ and \d+ more\)",
        task="causal-lm",
    ),
    "one-unrelated-tensor-sentence-embedding": Case(
        "st",
        _one_unrelated_tensor,
        r"--model: the weights in {m} do not cover its config\.json: 37 of its \d+ tensors are "
        r"missing \(embeddings\.\S+, embeddings\.\S+ and 35 more\)",
        task="sentence-embedding",
    ),
    "unsafe-pickle": Case(
        "classifier",
        _unsafe_pickle,
        r"--model: {m}/pytorch_model\.bin is a pickle that torch's safe loading refuses \(.*"
        r"GLOBAL .*mkdir.*\): memfit does not unpickle it",
    ),
    "custom-module-sentence-embedding": Case(
        "st",
        _custom_module,
        r"--model: cannot load {m}: The model {m} references the module class "
        r"'evil_pkg\.modules\.Pooling', which is not part of Sentence Transformers",
        task="sentence-embedding",
    ),
}


@pytest.fixture(scope="module")
def sources(
    tiny_classifier: str, gpt2_dir: str, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, str]:
    from tiny_models import save_sentence_transformer

    # a sentence-transformers folder (modules.json, mean pooling) of the tiny BERT
    st = tmp_path_factory.mktemp("st") / "model"
    save_sentence_transformer(st, Path(tiny_classifier), max_seq_length=32)
    return {"classifier": tiny_classifier, "gpt2": gpt2_dir, "st": str(st)}


def _train_file(folder: Path, task: str, long_row: int = 0) -> Path:
    path = folder / "t.csv"
    if task == "sentence-embedding":
        rows = ["anchor,positive", "w1 w2,w3 w4", "w5 w6,w7", "w8,w9 w10", "w11,w12"]
    elif task == "causal-lm":
        rows = ["text", "the cat sat on the mat", "the dog ran in the park"]
        rows += [" ".join(["the cat sat"] * (long_row // 3))] if long_row else []
    else:
        rows = ["text,label", "w1 w2 w3,0", "w4 w5,1", "w6 w7 w8,0", "w9,1"]
        rows += [" ".join(f"w{i % 60}" for i in range(long_row)) + ",1"] if long_row else []
    path.write_text("\n".join(rows) + "\n")
    return path


def _run_case(
    name: str, sources: dict[str, str], root: Path, capsys: pytest.CaptureFixture[str]
) -> tuple[int, list[str], Path, str]:
    case = CASES[name]
    folder = root / name
    folder.mkdir()
    model = case.model or str(folder / "model")
    if case.source is not None:
        shutil.copytree(sources[case.source], model)
        if case.defect is not None:
            case.defect(Path(model))
    out = folder / "out"
    argv = [
        "train",
        "--task",
        case.task,
        "--model",
        model,
        "--train-file",
        str(_train_file(folder, case.task, case.long_row)),
        "--output-dir",
        str(out),
        "--cache-dir",
        str(folder / "cache"),
        "--device",
        "cpu",
        "--effective-batch-size",
        "2",
        "--micro-batch-size",
        "2",
        "--optimizer",
        "sgd",
        "--max-steps",
        "1",
        *case.flags,
    ]
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    stderr = capsys.readouterr().err
    lines = [x for x in stderr.splitlines() if x.startswith(ERROR)]
    return int(exit_info.value.code or 0), lines, out, model


@pytest.mark.parametrize("name", list(CASES))
def test_defective_model_is_one_line_exit_2_nothing_written(
    name: str,
    sources: dict[str, str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, lines, out, model = _run_case(name, sources, tmp_path, capsys)
    assert code == 2, lines
    pattern = re.escape(ERROR) + CASES[name].error.replace("{m}", re.escape(model))
    assert len(lines) == 1 and re.match(pattern, lines[0]), (pattern, lines)
    assert not out.exists() or list(out.iterdir()) == []


def test_an_unsafe_pickle_is_never_unpickled(
    sources: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The refusal is torch's safe loader's: the planted object never ran."""
    code, _, _, model = _run_case("unsafe-pickle", sources, tmp_path, capsys)
    assert code == 2
    assert (Path(model) / "pytorch_model.bin").is_file()
    assert not (Path(model).parent / "pickle-ran").exists()


@pytest.mark.parametrize(
    ("source", "task"),
    [
        ("classifier", "classification"),  # a bare BertModel: the classifier head is new
        ("gpt2", "causal-lm"),  # lm_head is tied to the embeddings: not in the weights file
        ("gpt2", "classification"),  # GPT-2's score head is new
        ("st", "sentence-embedding"),
    ],
)
def test_a_new_task_head_is_trained_not_refused(
    sources: dict[str, str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    source: str,
    task: str,
) -> None:
    """What the weights lack beyond the body (a head the task adds) is what a run trains."""
    out = tmp_path / "out"
    argv = [
        "train", "--task", task, "--model", sources[source],
        "--train-file", str(_train_file(tmp_path, task)), "--output-dir", str(out),
        "--cache-dir", str(tmp_path / "cache"), "--device", "cpu", "--effective-batch-size", "2",
        "--micro-batch-size", "2", "--optimizer", "sgd", "--max-steps", "1",
    ]  # fmt: skip
    main(argv)
    assert ERROR not in capsys.readouterr().err
    assert (out / "model").is_dir()


def test_the_program_exits_2_without_traceback(tiny_classifier: str, tmp_path: Path) -> None:
    """The real program (no in-process shortcut) on one defect: exit 2, one line, no traceback."""
    model = tmp_path / "model"
    shutil.copytree(tiny_classifier, model)
    _truncated_safetensors(model)
    out = tmp_path / "out"
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "memfit",
            "train",
            "--task",
            "classification",
            "--model",
            str(model),
            "--train-file",
            str(_train_file(tmp_path, "classification")),
            "--output-dir",
            str(out),
            "--cache-dir",
            str(tmp_path / "cache"),
            "--device",
            "cpu",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    assert [x for x in done.stderr.splitlines() if x.strip()] == [
        f"{ERROR}--model: {model}/model.safetensors is truncated or corrupt: "
        + done.stderr.split("is truncated or corrupt: ", 1)[1].strip()
    ]
    assert not out.exists()


# --- memfit predict / embed MODEL_DIR: the same checks ---------------------------------------
INFER_CASES: dict[str, tuple[str, Callable[[Path], None], str]] = {
    # name: (verb, defect, the one line after "MODEL_DIR: "; {m}: the model folder)
    "predict-truncated-safetensors": (
        "predict",
        _truncated_safetensors,
        r"{m}/model\.safetensors is truncated or corrupt",
    ),
    "predict-truncated-bin": ("predict", _truncated_bin, r"{m}/pytorch_model\.bin is truncated"),
    "predict-sizes-disagree": (
        "predict",
        _sizes_disagree,
        r"the weights in {m} do not fit its config\.json: \S+ is [\d×]+ in the weights, [\d×]+ by",
    ),
    "predict-no-tokenizer": ("predict", _no_tokenizer, r"{m} holds no tokenizer"),
    "embed-truncated-safetensors": (
        "embed",
        _truncated_safetensors,
        r"{m}/model\.safetensors is truncated or corrupt",
    ),
    "embed-sizes-disagree": (
        "embed",
        _sizes_disagree,
        r"the weights in {m} do not fit its config\.json: \S+ is [\d×]+ in the weights, [\d×]+ by",
    ),
    "embed-no-tokenizer": ("embed", _no_tokenizer, r"{m} holds no tokenizer"),
    "embed-no-weights": (
        "embed",
        _no_weights,
        r"{m} holds no weights \(model\.safetensors or pytorch_model\.bin\): the outputs would "
        r"be random",
    ),
    "predict-one-unrelated-tensor": (
        "predict",
        _one_unrelated_tensor,
        r"the weights in {m} do not cover its config\.json: \d+ of its \d+ tensors are missing "
        r"\(transformer\.\S+, transformer\.\S+ and \d+ more\), and the outputs would be random",
    ),
    "predict-more-layers": (
        "predict",
        _more_layers,
        r"the weights in {m} do not cover its config\.json: \d+ of its \d+ tensors are missing "
        r"\(transformer\.h\.2\.",
    ),
    "predict-unsafe-pickle": (
        "predict",
        _unsafe_pickle,
        r"{m}/pytorch_model\.bin is a pickle that torch's safe loading refuses",
    ),
    "embed-one-unrelated-tensor": (
        "embed",
        _one_unrelated_tensor,
        r"the weights in {m} do not cover its config\.json: 37 of its \d+ tensors are missing",
    ),
}


@pytest.mark.parametrize("name", list(INFER_CASES))
def test_defective_model_dir_in_predict_and_embed(
    name: str,
    sources: dict[str, str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    verb, defect, error = INFER_CASES[name]
    model = tmp_path / "model"
    # predict: the causal LM (its head is saved); embed: the BERT encoder (mean pooling)
    shutil.copytree(sources["gpt2" if verb == "predict" else "classifier"], model)
    defect(model)
    data = tmp_path / "f.csv"
    data.write_text("text\nthe cat sat on the mat\nw1 w2 w3\n")
    output = tmp_path / ("o.jsonl" if verb == "predict" else "o.npy")
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main([verb, str(model), "--file", str(data), "--output", str(output), "--device", "cpu"])
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith(ERROR)]
    assert exit_info.value.code == 2, lines
    pattern = re.escape(ERROR + "MODEL_DIR: ") + error.replace("{m}", re.escape(str(model)))
    assert len(lines) == 1 and re.match(pattern, lines[0]), (pattern, lines)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.csv", "model"]
