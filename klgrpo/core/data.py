"""Prompt datasets and the deterministic, resumable prompt sampler.

``load_prompts`` reads a .jsonl/.json/.csv/.parquet file, a local dataset folder or a hub dataset (the last two
through the optional ``datasets`` library) into a ``PromptDataset``: one prompt per row plus every other column,
which the reward functions receive as keyword arguments. ``data.columns`` renames dataset columns to the names
the reward functions expect ({"answer": "solution"} hands the dataset's ``solution`` column over as ``answer``).

A prompt is a non-empty string or a chat message list [{"role": "user", "content": "..."}, ...]. Every bad
input raises ``DataError`` with one sentence naming the file, the row (1-based line for JSON Lines, 1-based
data row otherwise), the column and the fix.

``PromptSampler`` draws batches of prompt indices epoch after epoch; epoch e is the permutation drawn by a
``torch.Generator`` seeded with ``seed + e``, so a sampler restored from ``state_dict()`` continues with
exactly the indices an uninterrupted one would have drawn.
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from klgrpo.errors import ConfigError, DataError

#: File types read directly, by extension.
FILE_SUFFIXES = (".jsonl", ".ndjson", ".json", ".csv", ".parquet")

#: Names that cannot be dataset columns: the reward functions take them as their first two arguments.
RESERVED_COLUMNS = ("prompts", "completions")

_PIP_DATA = 'pip install "klgrpo[data]"'


@dataclass
class PromptDataset:
    """Prompts (``prompts[i]``: a string or a chat message list) and the other columns, row-aligned."""

    prompts: list
    columns: dict[str, list]
    source: str

    def __len__(self) -> int:
        return len(self.prompts)

    def __getitem__(self, i: int) -> dict:
        row = {"prompt": self.prompts[i]}
        row.update({name: values[i] for name, values in self.columns.items()})
        return row

    def batch(self, indices: list[int]) -> tuple[list, dict[str, list]]:
        """The prompts and columns of the rows ``indices``, in that order."""
        prompts = [self.prompts[i] for i in indices]
        columns = {name: [values[i] for i in indices] for name, values in self.columns.items()}
        return prompts, columns


def dataset_prompts(dataset) -> list:
    """Every prompt of a training set: a PromptDataset's own list, or the "prompt" of each row of a dataset a
    caller handed in (anything indexable whose rows are dicts)."""
    prompts = getattr(dataset, "prompts", None)
    return prompts if prompts is not None else [row["prompt"] for row in dataset]


def load_prompts(
    source: str,
    *,
    prompt_column: str = "prompt",
    columns: dict[str, str] | None = None,
    split: str = "train",
    limit: int | None = None,
    field: str = "data.source",
) -> PromptDataset:
    """Read a prompt dataset; errors name ``field`` (the config field that named ``source``).

    source: a .jsonl/.ndjson/.json/.csv/.parquet file, a local dataset folder, or a hub dataset name
        (``"openai/gsm8k:main"`` picks the config ``main``); the last two need ``pip install "klgrpo[data]"``.
    prompt_column: the dataset column holding the prompts.
    columns: {our_name: dataset_column} renames for the reward functions; the dataset's column is
        handed over under our name only. Every column not mapped keeps its own name.
    split: the split of a hub dataset or dataset folder.
    limit: keep only the first ``limit`` rows.
    """
    try:
        return _load_prompts(source, prompt_column, columns, split, limit)
    except UnicodeDecodeError as exc:
        raise DataError(_not_utf8(Path(str(source)).expanduser(), exc, field)) from None
    except DataError as exc:
        if field == "data.source":
            raise
        raise DataError(exc.message.replace("data.source", field)) from None


def _not_utf8(path: Path, exc: UnicodeDecodeError, field: str) -> str:
    """The first line of ``path`` that is not UTF-8, for the error message."""
    try:
        for lineno, line in enumerate(path.read_bytes().split(b"\n"), start=1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as bad:
                return (f"{path} line {lineno} is not UTF-8 text (byte {line[bad.start]:#04x} at column "
                        f"{bad.start + 1}); save the file as UTF-8 (it is {field})")
    except OSError:
        pass
    return f"{path} is not UTF-8 text ({exc.reason}); save the file as UTF-8 (it is {field})"


def _load_prompts(source, prompt_column, columns, split, limit) -> PromptDataset:
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ConfigError(f"data.limit must be a positive integer or null, got {limit!r}")
    mapping = dict(columns or {})
    for ours, theirs in mapping.items():
        if not isinstance(ours, str) or not isinstance(theirs, str) or not ours or not theirs:
            raise ConfigError(f"data.columns must map names to dataset column names, got {ours!r}: {theirs!r}")
    if "prompt" in mapping:
        if prompt_column not in ("prompt", mapping["prompt"]):
            raise ConfigError(f"data.columns maps 'prompt' to {mapping['prompt']!r} but data.prompt_column is "
                              f"{prompt_column!r}; set only data.prompt_column")
        prompt_column = mapping.pop("prompt")

    source = str(source)
    path = Path(source).expanduser()
    suffix = path.suffix.lower()
    if path.is_dir():
        rows, label = _read_datasets(source, split, limit, local=True)
    elif path.is_file():
        if suffix not in FILE_SUFFIXES:
            raise DataError(f"{source} has the extension {suffix or '(none)'!r}, which klgrpo cannot read; "
                            f"convert it to .jsonl, .json, .csv or .parquet")
        rows, label = _FILE_READERS[suffix](path, limit)
    elif suffix in FILE_SUFFIXES:
        raise DataError(f"prompt file {source} not found (relative paths start at {Path.cwd()}); "
                        f"check data.source")
    else:
        rows, label = _read_datasets(source, split, limit, local=False)

    if limit is not None:
        rows = rows[:limit]
    if not rows:
        raise DataError(f"{source} contains no rows; add at least one prompt")
    return _build(rows, label, source, prompt_column, mapping)


def _build(rows: list[dict], label: Callable[[int], str], source: str, prompt_column: str,
           mapping: dict[str, str]) -> PromptDataset:
    # Columns in order of first appearance; a JSON Lines row may omit a column other rows have.
    present: dict[str, None] = {}
    for row in rows:
        present.update(dict.fromkeys(row))
    existing = ", ".join(repr(c) for c in present) or "none"
    if prompt_column not in present:
        raise DataError(f"{source} has no column {prompt_column!r} (its columns are: {existing}); "
                        f"set data.prompt_column to the column that holds the prompts")
    for ours, theirs in mapping.items():
        if theirs not in present:
            raise DataError(f"{source} has no column {theirs!r}, which data.columns maps to {ours!r} "
                            f"(its columns are: {existing}); fix data.columns")

    # Output name -> dataset column: mapped columns under our name, the rest under their own.
    renamed = set(mapping.values())
    out_to_in = {c: c for c in present if c != prompt_column and c not in renamed}
    out_to_in.update(mapping)
    for name in ("prompt", *RESERVED_COLUMNS):
        if name in out_to_in:
            raise DataError(f"{source} has a column {out_to_in[name]!r} besides the prompt column "
                            f"{prompt_column!r} that would reach the reward functions as {name!r}, a reserved "
                            f"name; rename it with data.columns, e.g. {{'{name}_column': '{out_to_in[name]}'}}")

    prompts = []
    for i, row in enumerate(rows):
        if prompt_column not in row:
            raise DataError(f"{source} {label(i)} has no {prompt_column!r} field; add a prompt or remove the row")
        prompts.append(_check_prompt(row[prompt_column], f"{source} {label(i)}", prompt_column))
    out_columns: dict[str, list] = {}
    for ours, theirs in out_to_in.items():
        if ours in mapping:
            for i, row in enumerate(rows):
                if theirs not in row:
                    raise DataError(f"{source} {label(i)} has no {theirs!r} field, which data.columns maps to "
                                    f"{ours!r}; add it or remove the row")
        out_columns[ours] = [row.get(theirs) for row in rows]
    return PromptDataset(prompts=prompts, columns=out_columns, source=source)


def _check_prompt(value: Any, where: str, column: str) -> str | list:
    chat_hint = 'a non-empty string or a list of chat messages like [{"role": "user", "content": "..."}]'
    if isinstance(value, str):
        if not value.strip():
            raise DataError(f"{where}: the prompt in column {column!r} is empty; give the row a prompt or remove it")
        return value
    if isinstance(value, (list, tuple)):
        if not value:
            raise DataError(f"{where}: the chat prompt in column {column!r} has no messages; it must be {chat_hint}")
        messages = []
        for k, message in enumerate(value, start=1):
            ok = (isinstance(message, dict) and isinstance(message.get("role"), str) and message["role"].strip()
                  and isinstance(message.get("content"), str))
            if not ok:
                raise DataError(f"{where}: message {k} of the chat prompt in column {column!r} is "
                                f"{_preview(message)}; each message must be an object with string 'role' and "
                                f"'content' keys")
            messages.append(dict(message))
        if not any(m["content"].strip() for m in messages):
            raise DataError(f"{where}: every message of the chat prompt in column {column!r} is empty; "
                            f"give the row a prompt or remove it")
        return messages
    if value is None:
        raise DataError(f"{where}: the prompt in column {column!r} is empty; give the row a prompt or remove it")
    raise DataError(f"{where}: the prompt in column {column!r} is of type {type(value).__name__} "
                    f"({_preview(value)}); it must be {chat_hint}")


def _preview(value: Any, width: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


# ---------------------------------------------------------------------------------------------- readers
# Each returns (rows, label): the rows as dicts and label(i) naming row i for an error message.

def _read_jsonl(path: Path, limit: int | None) -> tuple[list[dict], Callable[[int], str]]:
    rows, line_numbers = [], []
    with _open_text(path) as f:
        for lineno, line in enumerate(f, start=1):
            if limit is not None and len(rows) >= limit:
                break
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path} line {lineno} is not valid JSON ({e.msg} at column {e.colno}); "
                                f"fix or remove that line") from None
            if not isinstance(record, dict):
                raise DataError(f"{path} line {lineno} holds a JSON {_json_type(record)}, not an object; "
                                f'each line must be one object such as {{"prompt": "..."}}')
            rows.append(record)
            line_numbers.append(lineno)
    return rows, lambda i: f"line {line_numbers[i]}"


def _read_json(path: Path, limit: int | None) -> tuple[list[dict], Callable[[int], str]]:
    with _open_text(path) as f:
        text = f.read()
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        if _first_line_is_object(text):
            return _read_jsonl(path, limit)  # JSON Lines saved as .json (what `datasets` writes)
        raise DataError(f"{path} is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}); "
                        f"fix the file") from None
    shape_hint = 'a list of objects [{"prompt": ...}, ...] or an object of equal-length columns {"prompt": [...]}'
    if isinstance(data, dict) and data and all(isinstance(v, list) for v in data.values()):
        lengths = {name: len(v) for name, v in data.items()}
        if len(set(lengths.values())) > 1:
            raise DataError(f"{path} holds columns of different lengths ({lengths}); give every column "
                            f"the same number of values")
        n = next(iter(lengths.values()))
        rows = [{name: values[i] for name, values in data.items()} for i in range(n)]
    elif isinstance(data, list):
        rows = data
        for i, record in enumerate(rows):
            if not isinstance(record, dict):
                raise DataError(f"{path} record {i + 1} is a JSON {_json_type(record)}, not an object; "
                                f"the file must hold {shape_hint}")
    else:
        raise DataError(f"{path} holds a JSON {_json_type(data)}; it must hold {shape_hint}")
    return rows, lambda i: f"record {i + 1}"


def _first_line_is_object(text: str) -> bool:
    first = next((line for line in text.splitlines() if line.strip()), "")
    try:
        return isinstance(json.loads(first), dict)
    except json.JSONDecodeError:
        return False


def _read_csv(path: Path, limit: int | None) -> tuple[list[dict], Callable[[int], str]]:
    rows = []
    with _open_text(path, newline="") as f:
        reader = csv.DictReader(f)
        try:
            for record in reader:
                if limit is not None and len(rows) >= limit:
                    break
                if None in record:  # more fields than the header names
                    raise DataError(f"{path} row {len(rows) + 1} has more fields than the header's "
                                    f"{len(reader.fieldnames or [])}; quote values that contain commas")
                rows.append(record)
        except csv.Error as e:
            raise DataError(f"{path} row {len(rows) + 1} cannot be parsed as CSV ({e}); fix that row") from None
    return rows, lambda i: f"row {i + 1}"


def _read_parquet(path: Path, limit: int | None) -> tuple[list[dict], Callable[[int], str]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"reading {path} needs pyarrow; install it with {_PIP_DATA}") from None
    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises several types for a bad file
        raise DataError(f"{path} cannot be read as Parquet ({_one_line(e)}); check the file") from None
    if limit is not None:
        table = table.slice(0, limit)
    return table.to_pylist(), lambda i: f"row {i + 1}"


_FILE_READERS = {
    ".jsonl": _read_jsonl,
    ".ndjson": _read_jsonl,
    ".json": _read_json,
    ".csv": _read_csv,
    ".parquet": _read_parquet,
}


def _read_datasets(source: str, split: str, limit: int | None, local: bool) -> tuple[list[dict], Callable]:
    try:
        import datasets
    except ImportError:
        what = f"the dataset folder {source}" if local else (
            f"{source!r} (no local file or folder has that name, so it is taken as a hub dataset)")
        raise DataError(f"reading {what} needs the datasets library; install it with {_PIP_DATA}") from None
    try:
        folder = Path(source)
        if local and ((folder / "dataset_dict.json").exists() or (folder / "state.json").exists()):
            data = datasets.load_from_disk(source)  # written by save_to_disk
            if hasattr(data, "keys"):
                if split not in data:
                    raise DataError(f"{source} has no split {split!r} (its splits are: {', '.join(data)}); "
                                    f"set data.split")
                data = data[split]
        else:
            name, _, config = source.partition(":") if not local else (source, "", "")
            data = datasets.load_dataset(name, config or None, split=split)
    except DataError:
        raise
    except Exception as e:  # the library raises many types: missing name, split, network, format
        raise DataError(f"cannot load dataset {source!r} split {split!r} ({_one_line(e)}); check data.source "
                        f"and data.split") from None
    if limit is not None and len(data) > limit:
        data = data.select(range(limit))
    column_data = data.to_dict()
    n = len(data)
    rows = [{name: values[i] for name, values in column_data.items()} for i in range(n)]
    return rows, lambda i: f"row {i + 1}"


def _open_text(path: Path, newline: str | None = None):
    try:
        return open(path, encoding="utf-8-sig", newline=newline)
    except OSError as e:
        raise DataError(f"cannot open {path} ({e.strerror}); check data.source and the file's permissions") from None


def _json_type(value: Any) -> str:
    return {list: "array", dict: "object", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), "number")


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split()) or type(error).__name__
    return text if len(text) <= 200 else text[:197] + "..."


# ---------------------------------------------------------------------------------------------- sampler

class PromptSampler:
    """Batches of prompt indices, epoch after epoch, resumable exactly.

    Epoch e visits every index once, in the order ``torch.randperm(dataset_len)`` draws from a generator
    seeded with ``seed + e`` (or in order when ``shuffle`` is False). A batch that reaches the end of an epoch
    continues at the start of the next one, so every batch has exactly ``batch_size`` indices.
    """

    def __init__(self, dataset_len: int, batch_size: int, seed: int, shuffle: bool = True):
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ConfigError(f"the prompt batch size must be a positive integer, got {batch_size!r}")
        if isinstance(dataset_len, bool) or not isinstance(dataset_len, int) or dataset_len < 1:
            raise ConfigError(f"the prompt sampler needs at least one prompt, got dataset_len={dataset_len!r}")
        self.dataset_len = dataset_len
        self.batch_size = batch_size
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.epoch = 0
        self.position = 0  # next index into this epoch's order
        self._order: list[int] | None = None

    def epoch_order(self, epoch: int) -> list[int]:
        """The order in which epoch ``epoch`` visits the indices."""
        if not self.shuffle:
            return list(range(self.dataset_len))
        generator = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(self.dataset_len, generator=generator).tolist()

    def next_indices(self) -> list[int]:
        indices: list[int] = []
        while len(indices) < self.batch_size:
            if self._order is None:
                self._order = self.epoch_order(self.epoch)
            take = min(self.batch_size - len(indices), self.dataset_len - self.position)
            indices.extend(self._order[self.position: self.position + take])
            self.position += take
            if self.position == self.dataset_len:
                self.epoch, self.position, self._order = self.epoch + 1, 0, None
        return indices

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed,
                "dataset_len": self.dataset_len, "shuffle": self.shuffle}

    def load_state_dict(self, state: dict) -> None:
        # A different dataset size, seed or order would silently continue a different sequence.
        for key in ("dataset_len", "seed", "shuffle"):
            if key in state and state[key] != getattr(self, key):
                raise ConfigError(f"the checkpoint's prompt sampler has {key}={state[key]!r} but this run has "
                                  f"{key}={getattr(self, key)!r}; resume with the same data and seed, or start "
                                  f"a new run")
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position < self.dataset_len:
            raise ConfigError(f"the checkpoint's prompt sampler position (epoch {epoch}, position {position}) "
                              f"does not fit a dataset of {self.dataset_len} prompts; start a new run")
        self.epoch, self.position, self._order = epoch, position, None


__all__ = ["PromptDataset", "PromptSampler", "load_prompts", "FILE_SUFFIXES", "RESERVED_COLUMNS"]
