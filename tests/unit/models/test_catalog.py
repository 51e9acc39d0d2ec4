"""`memfit models` reads the registry's stored listing (memfit.models.catalog), which a recount
from today's configs must reproduce exactly; a config that changed since is counted live."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib import resources
from typing import Any

import pytest

from memfit.models import catalog, parameter_count, registry_names, resolve_model


@pytest.mark.slow
def test_stored_listing_is_what_a_recount_writes() -> None:
    # every row (type, positions, parameter count, config digest) recomputed with
    # memfit.models.parameter_count: the stored file cannot drift from the configs or the code
    stored = (resources.files("memfit.models") / "configs" / catalog.LISTING_FILE).read_text(
        encoding="utf-8"
    )
    assert stored == catalog.generated_listing(), "run: python -m memfit.models.catalog"


def test_every_entry_has_a_current_stored_row() -> None:
    rows = catalog.stored_rows()
    assert list(rows) == registry_names()
    for name, row in rows.items():
        assert row["config_sha256"] == catalog.config_digest(name)


def test_models_verb_imports_neither_torch_nor_transformers() -> None:
    script = (
        "import sys\n"
        "from memfit.cli import main\n"
        "main(['models', '--json'])\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules), file=sys.stderr)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=120
    )
    assert done.stderr.strip().splitlines()[-1] == "[]"
    rows = json.loads(done.stdout)
    assert [row["name"] for row in rows] == registry_names()
    assert all(isinstance(row["parameters"], int) and row["parameters"] > 0 for row in rows)


@pytest.mark.parametrize("change", ["config changed", "no stored row"])
def test_an_entry_whose_stored_row_does_not_hold_is_counted_live(
    monkeypatch: pytest.MonkeyPatch, change: str
) -> None:
    name = "distilgpt2"
    rows = catalog.stored_rows()
    if change == "no stored row":
        del rows[name]
    else:
        # a row computed from another config: its figures must not be shown
        rows[name] = {**rows[name], "config_sha256": "0" * 64, "parameters": 1}
    monkeypatch.setattr(catalog, "stored_rows", lambda: rows)
    computed: list[str] = []
    listed = {row["name"]: row for row in catalog.listing(on_compute=computed.append)}
    assert computed == [name]
    spec = resolve_model(name)
    expected: dict[str, Any] = {
        "name": name,
        "model_type": spec.config.model_type,
        "max_positions": spec.max_positions,
        "parameters": parameter_count(spec),
    }
    assert listed[name] == expected
