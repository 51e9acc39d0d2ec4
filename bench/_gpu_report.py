"""What the GPU benches share: nvidia-smi's view of the GPU and a JSON file rewritten after every
case (an interrupted run keeps what it measured). Only the standard library: the device machine's
bench processes import it before torch."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any


def nvidia_smi() -> dict[str, str | None]:
    """``{"nvidia_smi": "name, driver, memory", "driver": ...}``, or Nones without nvidia-smi."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return {"nvidia_smi": None, "driver": None}
    try:
        done = subprocess.run(
            [smi, "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        )
        line = done.stdout.strip().splitlines()[0]
        return {"nvidia_smi": line, "driver": line.split(",")[1].strip()}
    except (OSError, subprocess.SubprocessError, IndexError):
        return {"nvidia_smi": None, "driver": None}


def write_json(path: Path | None, data: Any, *, indent: int = 2) -> None:
    """Write ``data`` to ``path`` whole or not at all (a temporary file moved into place)."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=indent, default=str) + "\n", encoding="utf-8")
    os.replace(tmp, path)


class Report:
    """``{"header", "cases", "summary"}`` in a JSON file, rewritten after every case."""

    def __init__(self, path: Path | None, head: dict[str, Any]) -> None:
        self.path = path
        self.data: dict[str, Any] = {"header": head, "cases": [], "summary": {}}
        self.write()

    def case(self, row: dict[str, Any]) -> None:
        self.data["cases"].append(row)
        self.write()

    def write(self) -> None:
        write_json(self.path, self.data)
