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

import contextlib
import errno
import json
import os
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import numpy as np

from memfit.errors import UsageError

EMBED_SUFFIXES = (".npy", ".parquet")

OutputT = TypeVar("OutputT", bound="AtomicOutput")


def check_output(path: str | Path, suffixes: tuple[str, ...]) -> list[str]:
    """Problems with ``--output``: a suffix the command does not write, a folder that is missing
    or cannot be written in, a folder where the file should be (checked before any work)."""
    from memfit.paths import file_problem

    out = Path(path)
    problems = []
    if out.suffix.lower() not in suffixes:
        problems.append(
            f"--output: {out} must end in {' or '.join(suffixes)} "
            f"(got {out.suffix or 'no suffix'!r})"
        )
    problem = file_problem(out, "--output")
    if problem is not None:
        problems.append(problem)
    return problems


class AtomicOutput:
    """A file written under a temporary name and renamed into place at the end (a context
    manager: a clean exit commits, an exception removes the temporary file). A disk that fills
    up (or a folder that stops taking writes) half-way is a UsageError naming ``--output``, and
    the temporary file is gone."""

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

    @contextlib.contextmanager
    def _writing(self) -> Iterator[None]:
        """Around every write: a disk or folder that refuses it (full, read-only, gone) is a
        UsageError naming ``--output``; the caller's exit then removes the temporary file."""
        from memfit.paths import is_user_os_error

        try:
            yield
        except OSError as exc:
            if not is_user_os_error(exc):
                raise
            raise UsageError(
                f"--output: {self.path}: {exc.strerror or exc}; nothing was written (the partial "
                "file was removed)"
            ) from None

    def _close(self) -> None:
        """Flush and close what is open (subclasses)."""

    def commit(self) -> None:
        with self._writing():
            self._close()
            if not self.temporary.exists():
                raise RuntimeError(f"{self.path}: nothing was written")  # pragma: no cover
            os.replace(self.temporary, self.path)

    def abort(self) -> None:
        try:
            self._close()
        except OSError:
            pass  # a full disk refuses the last flush too: the file goes anyway
        finally:
            self.temporary.unlink(missing_ok=True)


class JsonlOutput(AtomicOutput):
    """One JSON object per line."""

    def __init__(self, path: str | Path) -> None:
        super().__init__(path)
        with self._writing():
            self._handle = open(self.temporary, "w", encoding="utf-8")  # noqa: SIM115 - closed in _close

    def write(self, records: list[dict[str, Any]]) -> None:
        text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
        with self._writing():
            self._handle.write(text)
        self.rows += len(records)

    def _close(self) -> None:
        if not self._handle.closed:
            try:
                self._handle.flush()
                os.fsync(self._handle.fileno())
            finally:
                # closed even when the flush fails (a full disk): a second close has nothing
                # left to flush
                with contextlib.suppress(OSError):
                    self._handle.close()


class NpyOutput(AtomicOutput):
    """A ``rows × dim`` float32 matrix in ``.npy`` format, filled block by block."""

    def __init__(self, path: str | Path, rows: int) -> None:
        super().__init__(path)
        self.total = rows
        self._matrix: np.memmap[Any, Any] | None = None

    def write(self, matrix: np.ndarray[Any, Any]) -> None:
        with self._writing():
            self._write(matrix)

    def _write(self, matrix: np.ndarray[Any, Any]) -> None:
        if self._matrix is None:
            # the width is known at the first block; the file holds every row from the start
            self._matrix = np.lib.format.open_memmap(
                self.temporary, mode="w+", dtype=np.float32, shape=(self.total, matrix.shape[1])
            )
            # the map's file is sparse: reserve its blocks now, so a disk too small is an
            # OSError here, not a SIGBUS when a page of the map is first written
            with open(self.temporary, "r+b") as handle:
                size = os.fstat(handle.fileno()).st_size
                with contextlib.suppress(AttributeError):  # no posix_fallocate (macOS)
                    try:
                        os.posix_fallocate(handle.fileno(), 0, size)
                    except OSError as exc:
                        if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                            raise  # EINVAL/EOPNOTSUPP: a file system without it
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
        with self._writing():
            self._write(rows, ids, matrix)

    def _write(self, rows: list[int], ids: list[Any] | None, matrix: np.ndarray[Any, Any]) -> None:
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
