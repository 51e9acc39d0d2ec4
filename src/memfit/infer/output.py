"""Output files, written atomically: a hidden temporary file beside the output, renamed over it
when every row is in; removed on any failure. An OUT that exists is replaced only by a complete
new one, and a run that fails leaves nothing half-written.

- :class:`JsonlOutput`: one JSON object per line (``memfit predict``);
- :class:`NpyOutput`: a float32 matrix, one row per input row (``memfit embed --output X.npy``),
  filled block by block through a memory map, so the embeddings never sit in RAM all at once;
- :class:`ParquetOutput`: columns ``row`` (the input row, 0-based), the id column where the input
  has one, and ``embedding`` (a list of float32), written one row group per block.

Every writer receives the blocks in input order (the runner restores the order of each block
before it writes), so a row's place in the file is its place in the input.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import numpy as np

from memfit.errors import UsageError

EMBED_SUFFIXES = (".npy", ".parquet")

OutputT = TypeVar("OutputT", bound="AtomicOutput")


def check_output(path: str | Path, suffixes: tuple[str, ...]) -> list[str]:
    """Problems with ``--output``: a suffix the command does not write, a missing folder."""
    out = Path(path)
    problems = []
    if out.suffix.lower() not in suffixes:
        problems.append(
            f"--output: {out} must end in {' or '.join(suffixes)} "
            f"(got {out.suffix or 'no suffix'!r})"
        )
    if not out.parent.is_dir():
        problems.append(f"--output: the folder {out.parent} does not exist")
    elif out.is_dir():
        problems.append(f"--output: {out} is a folder; give a file name")
    return problems


class AtomicOutput:
    """A file written under a temporary name and renamed into place at the end (a context
    manager: a clean exit commits, an exception removes the temporary file)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        # hidden, beside the output: the same file system, so the rename is atomic
        self.temporary = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        self.rows = 0

    def __enter__(self: OutputT) -> OutputT:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if exc_type is not None:
            self.abort()
            return
        try:
            self.commit()
        except BaseException:
            self.abort()
            raise

    def _close(self) -> None:
        """Flush and close what is open (subclasses)."""

    def commit(self) -> None:
        self._close()
        if not self.temporary.exists():
            raise RuntimeError(f"{self.path}: nothing was written")  # pragma: no cover
        os.replace(self.temporary, self.path)

    def abort(self) -> None:
        try:
            self._close()
        finally:
            self.temporary.unlink(missing_ok=True)


class JsonlOutput(AtomicOutput):
    """One JSON object per line."""

    def __init__(self, path: str | Path) -> None:
        super().__init__(path)
        self._handle = open(self.temporary, "w", encoding="utf-8")  # noqa: SIM115 - closed in _close

    def write(self, records: list[dict[str, Any]]) -> None:
        self._handle.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
        self.rows += len(records)

    def _close(self) -> None:
        if not self._handle.closed:
            self._handle.flush()
            os.fsync(self._handle.fileno())
            self._handle.close()


class NpyOutput(AtomicOutput):
    """A ``rows × dim`` float32 matrix in ``.npy`` format, filled block by block."""

    def __init__(self, path: str | Path, rows: int) -> None:
        super().__init__(path)
        self.total = rows
        self._matrix: np.memmap[Any, Any] | None = None

    def write(self, matrix: np.ndarray[Any, Any]) -> None:
        if self._matrix is None:
            # the width is known at the first block; the file holds every row from the start
            self._matrix = np.lib.format.open_memmap(
                self.temporary, mode="w+", dtype=np.float32, shape=(self.total, matrix.shape[1])
            )
        self._matrix[self.rows : self.rows + len(matrix)] = matrix
        self.rows += len(matrix)

    def _close(self) -> None:
        if self._matrix is not None:
            self._matrix.flush()
            # drop the map before the rename (and before unlinking on abort)
            self._matrix = None

    def commit(self) -> None:
        if self.rows != self.total:  # pragma: no cover - the runner writes every row
            raise RuntimeError(f"{self.path}: {self.rows} of {self.total} rows written")
        super().commit()


class ParquetOutput(AtomicOutput):
    """Columns ``row``, the id column (optional) and ``embedding`` (list<float32>)."""

    def __init__(self, path: str | Path, *, id_column: str | None, id_kind: str | None) -> None:
        super().__init__(path)
        import pyarrow as pa

        if id_column in ("row", "embedding"):
            raise UsageError(
                f"--id-column: {id_column!r} is a column memfit embed writes itself; rename it"
            )
        fields = [pa.field("row", pa.int64())]
        if id_column is not None:
            fields.append(pa.field(id_column, pa.int64() if id_kind == "int" else pa.string()))
        fields.append(pa.field("embedding", pa.list_(pa.float32())))
        self.schema = pa.schema(fields)
        self.id_column = id_column
        self._writer: Any = None

    def write(self, rows: list[int], ids: list[Any] | None, matrix: np.ndarray[Any, Any]) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        if self._writer is None:
            self._writer = pq.ParquetWriter(str(self.temporary), self.schema)
        dim = matrix.shape[1]
        flat = pa.array(np.ascontiguousarray(matrix, dtype=np.float32).reshape(-1))
        offsets = pa.array(np.arange(0, (len(rows) + 1) * dim, dim, dtype=np.int32))
        columns: dict[str, Any] = {"row": pa.array(rows, pa.int64())}
        if self.id_column is not None:
            assert ids is not None
            kind = self.schema.field(self.id_column).type
            columns[self.id_column] = pa.array(
                ids if kind == pa.int64() else [str(i) for i in ids], kind
            )
        columns["embedding"] = pa.ListArray.from_arrays(offsets, flat)
        self._writer.write_table(pa.table(columns, schema=self.schema))
        self.rows += len(rows)

    def _close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
