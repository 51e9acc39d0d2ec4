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

While an output is open, SIGTERM and SIGHUP (where their handler is the default one: a handler
someone set, or ``nohup``'s SIG_IGN, stays) raise :class:`Terminated` instead of killing the
process, so the temporary file is removed on the way out as it is for SIGINT (KeyboardInterrupt)
and any exception: the output is whole or absent. A signal that arrives while the finished file
is renamed into place waits for the rename.

:func:`destination_problems`: ``--output`` and ``--events`` are never an input, never one file,
and never an existing file memfit cannot tell it wrote unless ``--overwrite``
(:func:`memfit.paths.destination_problems`).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import numpy as np

from memfit import paths
from memfit.data.sources import resolve_sources
from memfit.errors import UsageError
from memfit.paths import Kind, file_problem, first_json_record, is_user_os_error, never

EMBED_SUFFIXES = (".npy", ".parquet")
# the Parquet schema's metadata key (and value) that marks a file memfit embed wrote
PARQUET_MARK = (b"memfit", b"embed")
# what a signal that ends the process would leave behind: SIGINT is Python's KeyboardInterrupt
STOP_SIGNALS = tuple(
    getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name)
)

OutputT = TypeVar("OutputT", bound="AtomicOutput")


def check_output(path: str | Path, suffixes: tuple[str, ...]) -> list[str]:
    """Problems with ``--output``: a suffix the command does not write, a folder that is missing
    or cannot be written in, a folder where the file should be (checked before any work)."""
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


# --- what memfit wrote ------------------------------------------------------------------------
# the keys of a memfit predict record after "row" (and the id column, where the input has one), in
# the order memfit.infer.predict writes them: one layout per kind of model
_PREDICT_LAYOUTS = (
    ("label", "label_id", "probabilities"),  # a classifier
    ("label", "label_id", "labels", "probabilities"),  # a multi-label classifier
    ("score",),  # a regression head of one output
    ("scores",),  # a regression head of several
    ("loss", "perplexity", "tokens"),  # a causal LM
)


def _predict_output(path: Path) -> bool:
    """A file memfit predict wrote: every whole line in its first :data:`~memfit.paths.
    HEAD_BYTES` is one of its records (:func:`_predict_record`), the n-th with ``"row": n`` and
    all with the same keys in the same order.

    A JSON Lines file of the user's passes only where it has exactly that shape (``row``
    counting from 0 on every line, at most one other key before a layout of
    :data:`_PREDICT_LAYOUTS`, values of the types memfit writes there): a file of
    ``{"row": 0, "label": "pos", "text": …}`` lines is not memfit's."""
    with open(path, "rb") as handle:
        head = handle.read(paths.HEAD_BYTES)
    # the last piece is cut at HEAD_BYTES, or empty after the last newline: memfit ends each
    # line with one
    lines = head.split(b"\n")[:-1]
    keys: list[str] | None = None
    for number, line in enumerate(lines):
        try:
            record = json.loads(line)
        except ValueError:
            return False
        if not isinstance(record, dict) or not _predict_record(record, number):
            return False
        if keys is None:
            keys = list(record)
        elif list(record) != keys:
            return False
    return keys is not None


def _predict_record(record: dict[str, Any], number: int) -> bool:
    """``record`` is the line memfit predict writes for input row ``number``: ``row``, the id
    (a string or a number) where the input has one, then the keys of a layout with their types."""
    keys = list(record)
    if not keys or keys[0] != "row" or not _whole(record["row"]) or record["row"] != number:
        return False
    rest = keys[1:]
    for layout in _PREDICT_LAYOUTS:
        if rest[-len(layout) :] == list(layout) and len(rest) - len(layout) in (0, 1):
            break
    else:
        return False
    if len(rest) > len(layout):
        value = record[rest[0]]  # the id, copied from the input as it was
        if isinstance(value, bool) or not isinstance(value, str | int | float):
            return False
    return _predict_values(record, layout)


def _predict_values(record: dict[str, Any], layout: tuple[str, ...]) -> bool:
    """The values of ``layout``'s keys have the types memfit predict gives them."""
    if layout[0] == "label":
        probabilities = record["probabilities"]
        label = record["label"]
        if not (_floats(probabilities) and isinstance(label, str) and label in probabilities):
            return False
        if not (_whole(record["label_id"]) and record["label_id"] >= 0):
            return False
        labels = record.get("labels", [])
        return isinstance(labels, list) and all(
            isinstance(n, str) and n in probabilities for n in labels
        )
    if layout == ("score",):
        return isinstance(record["score"], float)
    if layout == ("scores",):
        return _floats(record["scores"])
    loss, perplexity, tokens = record["loss"], record["perplexity"], record["tokens"]
    if not _whole(tokens):
        return False
    if loss is None:  # a row of one token: nothing predicted
        return perplexity is None and tokens == 0
    return isinstance(loss, float) and isinstance(perplexity, float) and tokens >= 1


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _floats(value: Any) -> bool:
    """A non-empty object of names to floats (a record's ``probabilities``/``scores``)."""
    return (
        isinstance(value, dict)
        and bool(value)
        and all(isinstance(v, float) for v in value.values())
    )


def _embed_parquet(path: Path) -> bool:
    """A Parquet file memfit embed wrote: its schema carries :data:`PARQUET_MARK`."""
    # start-up time: pyarrow (datasets') loads only for Parquet output
    import pyarrow.parquet as pq

    metadata = pq.read_schema(path).metadata or {}
    return metadata.get(PARQUET_MARK[0]) == PARQUET_MARK[1]


def _events_log(path: Path) -> bool:
    """An ``--events`` log memfit predict or embed wrote: it starts with the run's plan."""
    record = first_json_record(path)
    return (
        record is not None
        and record.get("type") == "plan"
        and record.get("phase") in ("predict", "embed")
    )


OUTPUT_KINDS = {
    ".jsonl": Kind(_predict_output, "a memfit predict output"),
    ".parquet": Kind(_embed_parquet, "a memfit embed output"),
    # a .npy header holds the array's dtype, order and shape, and nothing more
    ".npy": Kind(never, "a .npy file"),
}
EVENTS_KIND = Kind(_events_log, "a memfit predict or embed --events log")


def destination_problems(
    *, output: str, events: str | None, file: str, model: Path | None, overwrite: bool
) -> list[str]:
    """Why ``--output`` or ``--events`` must not be written (:func:`memfit.paths.
    destination_problems`): an input (``--file``'s files or folder, the model folder), one file
    for both, or an existing file memfit cannot tell it wrote without ``--overwrite``."""
    try:
        files = [source.path for source in resolve_sources(file, "--file")]
    except UsageError:
        files = []  # the reader says what is wrong with --file, in its own words
    inputs = paths.data_inputs(file, "--file", files)
    if model is not None:
        inputs.append(paths.Input("MODEL_DIR", model, "model"))
    problems = []
    kind = OUTPUT_KINDS.get(Path(output).suffix.lower())
    if kind is not None:  # another suffix is check_output's problem
        problems += paths.destination_problems(
            output, "--output", kind, inputs=inputs, overwrite=overwrite
        )
    if events is not None:
        problems += paths.destination_problems(
            events,
            "--events",
            EVENTS_KIND,
            inputs=inputs,
            overwrite=overwrite,
            others=[("--output", output)],
            renamed=False,  # a log, opened and written through
        )
    return problems


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP while an output was open (a KeyboardInterrupt, as SIGINT is: no
    ``except Exception`` on the way out can swallow it). ``exit_code``: 128 + the signal."""

    def __init__(self, signum: int, path: Path, *, written: bool) -> None:
        name = signal.Signals(signum).name
        if written:
            told = f"stopped by {name} after --output {path} was written in full"
        else:
            told = (
                f"stopped by {name}: --output {path} was not written (the partial file was removed)"
            )
        super().__init__(told)
        self.exit_code = 128 + int(signum)


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
        self._previous: dict[int, Any] = {}
        self._closing = False
        self._pending: int | None = None

    def __enter__(self: OutputT) -> OutputT:
        self._arm()
        try:
            self._open()
        except BaseException:
            self._closing = True
            self.abort()
            self._disarm()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        # a signal from here on waits: the temporary file is removed, or renamed into place
        self._closing = True
        try:
            if exc_type is not None:
                self.abort()
                return
            try:
                self.commit()
            except BaseException:
                self.abort()
                raise
        finally:
            self._disarm()
        if self._pending is not None:
            raise Terminated(self._pending, self.path, written=True)

    # -- signals ---------------------------------------------------------------------------------
    def _arm(self) -> None:
        """SIGTERM/SIGHUP raise :class:`Terminated` while the output is open (so the ``with``
        removes the temporary file) where their handler is the default, which would kill the
        process and leave it; Python sets handlers in the main thread only."""
        if threading.current_thread() is not threading.main_thread():
            return
        for signum in STOP_SIGNALS:
            if signal.getsignal(signum) is signal.SIG_DFL:
                self._previous[signum] = signal.signal(signum, self._on_signal)

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self._closing:
            self._pending = signum  # raised once the file is renamed into place, or removed
            return
        # removed here as well: the exception may surface in the first steps of __exit__, before
        # it would remove the file (only unlinked: closing a file whose write this interrupted
        # could re-enter its buffer; the ``with`` closes it on the way out)
        with contextlib.suppress(OSError):
            self.temporary.unlink(missing_ok=True)
        raise Terminated(signum, self.path, written=False)

    def _disarm(self) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous.clear()

    def _open(self) -> None:
        """Create the temporary file (subclasses that make it before the first block)."""

    @contextlib.contextmanager
    def _writing(self) -> Iterator[None]:
        """Around every write: a disk or folder that refuses it (full, read-only, gone) is a
        UsageError naming ``--output``; the caller's exit then removes the temporary file."""
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
        self._handle: Any = None

    def _open(self) -> None:
        with self._writing():
            self._handle = open(self.temporary, "w", encoding="utf-8")  # noqa: SIM115 - closed in _close

    def write(self, records: list[dict[str, Any]]) -> None:
        text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
        with self._writing():
            self._handle.write(text)
        self.rows += len(records)

    def _close(self) -> None:
        if self._handle is not None and not self._handle.closed:
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
        # start-up time: pyarrow (datasets') loads only for Parquet output
        import pyarrow as pa

        if id_column in ("row", "embedding"):
            raise UsageError(
                f"--id-column: {id_column!r} is a column memfit embed writes itself; rename it"
            )
        fields = [pa.field("row", pa.int64())]
        if id_column is not None:
            fields.append(pa.field(id_column, pa.int64() if id_kind == "int" else pa.string()))
        fields.append(pa.field("embedding", pa.list_(pa.float32())))
        # the mark a later run knows its own file by (memfit.paths): replaced without --overwrite
        self.schema = pa.schema(fields, metadata=dict([PARQUET_MARK]))
        self.id_column = id_column
        self._writer: Any = None

    def write(self, rows: list[int], ids: list[Any] | None, matrix: np.ndarray[Any, Any]) -> None:
        with self._writing():
            self._write(rows, ids, matrix)

    def _write(self, rows: list[int], ids: list[Any] | None, matrix: np.ndarray[Any, Any]) -> None:
        # start-up time: pyarrow (datasets') loads only for Parquet output
        import pyarrow as pa
        import pyarrow.parquet as pq  # start-up time, as the line above

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
