"""Dataset sources: the rows of a Hugging Face Hub dataset, of a local file or directory, or in memory.

    rows("openai/gsm8k", "train", config="main")   a Hub dataset, through datasets.load_dataset
    rows("data/train.jsonl")                       one JSONL file (read here: errors name the line)
    rows("data/train.csv"), rows("x.parquet")      one CSV / Parquet / JSON file, through `datasets`
    rows("data/", "test")                          data/test.jsonl | .csv | .parquet | .json
    rows("saved/", "test")                         a datasets.save_to_disk directory (a dataset or a
                                                   DatasetDict, whose split is taken)
    Rows([{"prompt": ..., "answer": ...}, ...])    rows in memory (flags.config's dataset=): a list of
                                                   dicts or a datasets.Dataset

A row is a plain dict of one record's columns; tasks.py turns rows into Examples (which column is
the prompt, which the answer). A single file is one split: the split asked for is ignored, so the
same file serves training and evaluation unless another is given; so do rows in memory. Rows in memory
carry a label, "python: <n> rows, sha256 <12 hex digits>" of their content, which run_config.json keeps
in the dataset's place: a resumed run is refused unless it is handed the same rows.

`datasets` is imported only when a source needs it (a Hub id, a CSV, Parquet or JSON file, a saved
directory): a JSONL file and the built-in addition task read without it.

The Hub. Offline, `datasets` retries a connection for about half a minute before it fails with a
long traceback. So before it is asked for a Hub id, `hub_problem` tries the Hub's host once (a TCP
connection, HUB_PROBE_TIMEOUT_S) unless HF_HUB_OFFLINE=1 (then the local cache alone is read) or
a proxy is set (then only the library knows the route). Every failure is one line that names the
fix: a local file or directory, HF_HUB_OFFLINE=1 for a cached copy, or --dataset-config.

Test: tests/test_data.py (JSONL, CSV, Parquet, saved directories, TRL prompt formats, the offline
message).
"""
from __future__ import annotations

import hashlib
import json
import os
import socket
from urllib.parse import urlparse

HUB_PROBE_TIMEOUT_S = 3.0
FILE_FORMATS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}
LOCAL_FIX = ("pass a local file or directory (--dataset path/to/train.jsonl, .csv, .parquet or a "
             "datasets.save_to_disk directory)")
OFFLINE_FIX = LOCAL_FIX + ", or set HF_HUB_OFFLINE=1 to read a copy already in the cache"
IN_MEMORY = "python: "   # the start of a label of rows in memory (Rows)


class DatasetError(ValueError):
    """A dataset that cannot be used as it is (bad bytes, bad JSON, missing columns, an unreachable
    Hub, no rows): the message names the source and, for a file, the line; train.py and eval.py print
    it as one line."""


# ----------------------------------------------------------------------------------------------
# rows in memory


class Rows:
    """A dataset handed over in memory: a list (or tuple) of dicts, or a datasets.Dataset, in TRL's columns
    (a prompt, a string or a list of messages; the gold answer; any others for reward functions). `label`
    names it by its size and the sha256 of its content (JSON, keys sorted): what run_config.json records."""

    def __init__(self, rows):
        if hasattr(rows, "to_list") and not isinstance(rows, (list, tuple)):   # a datasets.Dataset
            rows = rows.to_list()
        elif isinstance(rows, dict):   # a DatasetDict, or a dict of columns
            raise ValueError(f"a dataset in memory is a list of rows (dicts) or a datasets.Dataset, not a "
                             f"{type(rows).__name__} (a DatasetDict: pass one split, e.g. dataset['train'])")
        if not isinstance(rows, (list, tuple)):
            raise ValueError(f"a dataset in memory is a list of rows (dicts) or a datasets.Dataset, not a "
                             f"{type(rows).__name__}")
        self.rows = list(rows)
        text = json.dumps(self.rows, sort_keys=True, default=repr, ensure_ascii=False)
        self.label = f"{IN_MEMORY}{len(self.rows)} rows, sha256 {hashlib.sha256(text.encode()).hexdigest()[:12]}"

    def __str__(self) -> str:
        return self.label

    def records(self) -> list[tuple[object, str]]:
        """[(row, where)], as the file sources give them."""
        return [(r, f"row {i} of the rows in memory") for i, r in enumerate(self.rows)]


# ----------------------------------------------------------------------------------------------
# local sources


def read_jsonl_records(path: str) -> list[tuple[object, str]]:
    """[(record, "path:line")] of every non-blank line of a JSONL file; bad bytes or JSON name the line."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no such JSONL file: {path}")
    out = []
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DatasetError(f"{where}: not UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1})") from None
            if not line.strip():
                continue
            try:
                out.append((json.loads(line), where))
            except json.JSONDecodeError as e:
                raise DatasetError(f"{where}: malformed JSON ({e.msg} at column {e.colno})") from None
    return out


def is_saved_dataset(path: str) -> bool:
    """True for a directory written by datasets' save_to_disk (a Dataset or a DatasetDict)."""
    return os.path.isfile(os.path.join(path, "dataset_dict.json")) or (
        os.path.isfile(os.path.join(path, "state.json")) and os.path.isfile(os.path.join(path, "dataset_info.json")))


def split_file(directory: str, split: str) -> str | None:
    """<directory>/<split>.<ext> for the first extension of FILE_FORMATS present, else None."""
    for ext in FILE_FORMATS:
        path = os.path.join(directory, split + ext)
        if os.path.isfile(path):
            return path
    return None


def saved_splits(path: str) -> list[str] | None:
    """The splits of a saved DatasetDict (from its dataset_dict.json); None for a saved Dataset."""
    index = os.path.join(path, "dataset_dict.json")
    if not os.path.isfile(index):
        return None
    with open(index, encoding="utf-8") as f:
        return list(json.load(f)["splits"])


def local_problem(path: str, split: str) -> str | None:
    """What rows(path, split) would refuse before reading a row (else None): the parse-time check."""
    if os.path.isdir(path):
        if is_saved_dataset(path):
            splits = saved_splits(path)
            return None if splits is None or split in splits else f"{path} has splits {splits}, not {split!r}"
        if split_file(path, split) is None:
            names = [split + ext for ext in FILE_FORMATS]
            return f"{path} holds none of {names} and is not a datasets.save_to_disk directory"
        return None
    ext = os.path.splitext(path)[1].lower()
    if ext not in FILE_FORMATS:
        return f"{path}: unknown file type {ext or '(none)'!r}; use one of {sorted(FILE_FORMATS)}"
    return None


def _library_rows(load, what: str) -> list[dict]:
    """Rows of a `datasets` call; its failures (a bad file, a missing split) become one DatasetError."""
    try:
        import datasets
    except ImportError:
        raise DatasetError(f"{what} is read through the `datasets` library: pip install datasets") from None
    try:
        ds = load(datasets)
    except (OSError, ValueError, datasets.exceptions.DatasetsError) as e:
        raise DatasetError(f"{what}: {root_cause(e)}") from None
    return ds.to_list()


def root_cause(e: BaseException) -> str:
    """The first line of the innermost exception e was raised from: `datasets` wraps a parser's error
    (pandas: "Error tokenizing data. C error: Expected 2 fields in line 3, saw 3") in its own, which
    says only "An error occurred while generating the dataset"."""
    while (e.__cause__ or e.__context__) is not None:
        e = e.__cause__ or e.__context__
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


def file_rows(path: str, split: str) -> list[tuple[dict, str]]:
    """[(row, where)] of a local file or directory (see the module docstring)."""
    problem = local_problem(path, split)
    if problem:
        raise DatasetError(problem)
    if os.path.isdir(path) and is_saved_dataset(path):
        def load(datasets):
            ds = datasets.load_from_disk(path)
            return ds[split] if isinstance(ds, datasets.DatasetDict) else ds
        return [(r, f"{path}[{i}]") for i, r in enumerate(_library_rows(load, path))]
    file = split_file(path, split) if os.path.isdir(path) else path
    if file.endswith(".jsonl"):
        return read_jsonl_records(file)
    fmt = FILE_FORMATS[os.path.splitext(file)[1].lower()]
    found = _library_rows(lambda datasets: datasets.load_dataset(fmt, data_files=file, split="train"), file)
    return [(r, f"{file}[{i}]") for i, r in enumerate(found)]


# ----------------------------------------------------------------------------------------------
# the Hub


def offline() -> bool:
    """HF_HUB_OFFLINE is set: the Hub libraries read their local cache only."""
    return os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on")


def one_line(e: BaseException) -> str:
    """An exception's message on one line (what train.py and eval.py print)."""
    return " ".join(str(e).split())


def hub_problem() -> str | None:
    """Why a Hub dataset cannot be fetched now (else None), found in at most HUB_PROBE_TIMEOUT_S."""
    if offline():
        return None  # the cache alone is read; a dataset not in it is reported by hub_rows
    if any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return None
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    host, port = url.hostname or "huggingface.co", url.port or (80 if url.scheme == "http" else 443)
    try:
        socket.create_connection((host, port), timeout=HUB_PROBE_TIMEOUT_S).close()
    except OSError as e:
        return f"the Hugging Face Hub ({host}) cannot be reached ({e.strerror or e})"
    return None


def hub_rows(name: str, split: str, config: str | None = None) -> list[tuple[dict, str]]:
    """[(row, where)] of a Hub dataset's split, or one DatasetError naming the fix."""
    problem = hub_problem()
    if problem:
        raise DatasetError(f"{name}: {problem}; {OFFLINE_FIX}")
    try:
        import datasets
    except ImportError:
        raise DatasetError(f"{name} is a Hub dataset, read through the `datasets` library: "
                           f"pip install datasets") from None
    try:
        ds = datasets.load_dataset(name, config, split=split)
    except ConnectionError as e:  # offline and not in the cache, or the connection failed mid-way
        if offline():
            raise DatasetError(f"{name} is not in the local cache and HF_HUB_OFFLINE=1 keeps the Hub off; "
                               f"{LOCAL_FIX}, or fetch it once online") from None
        raise DatasetError(f"{name} could not be fetched ({one_line(e)[:300]}); {OFFLINE_FIX}") from None
    except datasets.exceptions.DatasetNotFoundError:
        raise DatasetError(f"{name}: no such dataset on the Hub (or it is gated: log in with `hf auth login`); "
                           f"or pass a local file or directory") from None
    except ValueError as e:  # a config or split that is not there: its first line lists the choices
        text = " ".join(str(e).split("\n")[:2]).strip()
        raise DatasetError(f"{name}: {text}" + (" (--dataset-config)" if "onfig" in text else "")) from None
    except OSError as e:  # the Hub's other refusals (gated, rate-limited, ...)
        raise DatasetError(f"{name}: {one_line(e)[:300]}") from None
    where = f"{name}" + (f":{config}" if config else "") + f"[{split}]"
    return [(r, f"{where}[{i}]") for i, r in enumerate(ds.to_list())]


def looks_like_hub_id(name: str) -> bool:
    """'name' or 'org/name' (no path syntax, no file extension): what the Hub could hold."""
    parts = name.split("/")
    return (0 < len(parts) <= 2 and all(parts) and not name.startswith((".", "~"))
            and os.path.splitext(name)[1].lower() not in FILE_FORMATS)
