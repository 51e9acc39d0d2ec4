"""The inputs a data flag stands for (:func:`resolve_sources`): a data file, a folder of them, or a
``datasets`` ``save_to_disk`` folder (see :mod:`memfit.data.rows` for the formats). A folder entry
that is not a regular file or a link to one is refused by name and never opened.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

from memfit.errors import UsageError

FORMATS = (".csv", ".tsv", ".jsonl", ".json", ".parquet")


@dataclass(frozen=True)
class Source:
    """One readable input: a data file, or a ``save_to_disk`` folder (``split`` for a dict)."""

    path: Path
    kind: str  # csv | tsv | jsonl | json | parquet | arrow
    split: str | None = None

    @property
    def name(self) -> str:
        """The source as problems name it: its path, and the split of a ``DatasetDict``."""
        return str(self.path) + (f" [split {self.split}]" if self.split else "")

    @property
    def unit(self) -> str:
        """What a problem counts in: ``row`` for Parquet and ``save_to_disk`` data (no lines)."""
        return "row" if self.kind in ("parquet", "arrow") else "line"


def _kind_of(path: Path) -> str | None:
    name = path.name.lower()
    if name.endswith(".gz"):
        name = name[:-3]
    for suffix in FORMATS:
        if name.endswith(suffix):
            if suffix == ".parquet" and path.name.lower().endswith(".gz"):
                return None
            return suffix[1:]
    return None


def _is_saved_dataset(folder: Path) -> bool:
    return (folder / "dataset_dict.json").is_file() or (
        (folder / "state.json").is_file() and (folder / "dataset_info.json").is_file()
    )


def resolve_sources(path: str | Path, flag: str) -> list[Source]:
    """The inputs ``path`` stands for; a UsageError naming ``flag`` when there are none."""
    path = Path(path)
    if not path.exists():
        raise UsageError(f"{flag}: {path}: no such file or folder")
    if not path.is_file() and not path.is_dir():
        # a FIFO (``<(zcat …)``) would block the first open and could not be read twice
        raise UsageError(
            f"{flag}: {path}: {_entry_kind(path.stat())}, not a file or folder (memfit reads "
            "its data more than once: write it to a file)"
        )
    if path.is_file():
        kind = _kind_of(path)
        if kind is None:
            raise UsageError(
                f"{flag}: {path}: unknown format {_suffix(path)!r}; use .csv, .tsv, .jsonl, "
                ".json or .parquet (or a folder of them, or a datasets save_to_disk folder)"
            )
        return [Source(path, kind)]
    if _is_saved_dataset(path):
        return [Source(path, "arrow", _split_for(path, flag))]
    listing = _Listing()
    _walk(path, path, listing)
    files = sorted(listing.files)
    readable = [p for p in files if _kind_of(p) is not None]
    unreadable = [p for p in files if _kind_of(p) is None]
    problems = []
    if listing.odd:
        odd = sorted(listing.odd)
        names = ", ".join(f"{p.relative_to(path)} ({why})" for p, why in odd[:5])
        more = f" and {len(odd) - 5} more" if len(odd) > 5 else ""
        problems.append(
            f"{flag}: {path}: the folder holds entries memfit does not read: {names}{more} "
            "(it reads regular files and links to them; move the others out)"
        )
    if unreadable:
        names = ", ".join(str(p.relative_to(path)) for p in unreadable[:5])
        more = f" and {len(unreadable) - 5} more" if len(unreadable) > 5 else ""
        problems.append(
            f"{flag}: {path}: the folder holds files memfit cannot read: {names}{more} "
            "(it reads .csv, .tsv, .jsonl, .json, .parquet; move the others out)"
        )
    if problems:
        raise UsageError("\n".join(problems))
    if not readable:
        what = "only hidden files and job markers" if listing.hidden else "nothing"
        raise UsageError(
            f"{flag}: {path}: the folder holds no data files ({what}; memfit reads .csv, .tsv, "
            ".jsonl, .json, .parquet)"
        )
    return [Source(p, _kind_of(p) or "") for p in readable]


@dataclass
class _Listing:
    """What a data folder holds: its data files (regular files, or links to them), the entries
    refused (with why) and whether hidden entries were passed over."""

    files: list[Path] = field(default_factory=list)
    odd: list[tuple[Path, str]] = field(default_factory=list)
    hidden: bool = False


def _walk(folder: Path, root: Path, listing: _Listing) -> None:
    """List ``folder`` into ``listing``, down its subfolders; never opens an entry that is not a
    regular file (a FIFO blocks its reader) and never follows a link to a folder (loops)."""
    try:
        with os.scandir(folder) as scan:
            entries = list(scan)
    except OSError as exc:
        listing.odd.append((folder, f"a folder that cannot be listed: {exc.strerror or exc}"))
        return
    for entry in entries:
        path = Path(entry.path)
        if _hidden(path, root):
            listing.hidden = True
            continue
        try:
            if entry.is_dir(follow_symlinks=False):
                _walk(path, root, listing)
                continue
            if entry.is_file(follow_symlinks=False):
                listing.files.append(path)
                continue
            why = _odd_entry(path)
        except OSError as exc:
            why = f"cannot be read: {exc.strerror or exc}"
        if why is None:
            listing.files.append(path)  # a link to a regular file: read as that file
        else:
            listing.odd.append((path, why))


def _odd_entry(path: Path) -> str | None:
    """Why a folder entry that is neither a folder nor a regular file is refused; None for a
    link that resolves to a regular file."""
    if not path.is_symlink():
        return _entry_kind(path.lstat())
    try:
        target = path.stat()
    except OSError as exc:
        return "a link that loops" if exc.errno == errno.ELOOP else "a broken link"
    if stat.S_ISREG(target.st_mode):
        return None
    if stat.S_ISDIR(target.st_mode):
        return "a link to a folder"
    return f"a link to {_entry_kind(target)}"


def _entry_kind(info: os.stat_result) -> str:
    mode = info.st_mode
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "not a regular file"


def _suffix(path: Path) -> str:
    return "".join(path.suffixes[-2:]) if path.name.lower().endswith(".gz") else path.suffix


# marker files that jobs (Spark, Hadoop, managed services) leave beside their data
_MARKERS = ("_SUCCESS", "_metadata", "_common_metadata")


def _hidden(path: Path, root: Path) -> bool:
    # hidden files (.crc, .DS_Store) and job markers: never data
    parts = path.relative_to(root).parts
    name = path.name
    return (
        any(p.startswith(".") for p in parts)
        or name in _MARKERS
        or name.startswith(("_committed_", "_started_"))
    )


def _split_for(folder: Path, flag: str) -> str | None:
    index = folder / "dataset_dict.json"
    if not index.is_file():
        return None
    try:
        splits = list(json.loads(index.read_text(encoding="utf-8")).get("splits", []))
    except (OSError, ValueError):
        raise UsageError(f"{flag}: {folder}: dataset_dict.json is not readable JSON") from None
    wanted = ("train",) if flag == "--train-file" else ("validation", "eval", "test", "dev")
    for name in wanted:
        if name in splits:
            return name
    if len(splits) == 1:
        return splits[0]
    raise UsageError(
        f"{flag}: {folder}: a DatasetDict with splits {', '.join(splits)}; none is "
        f"{' or '.join(wanted)}: point {flag} at the split's own folder"
    )
