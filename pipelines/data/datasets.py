"""Prompt datasets: read a file or build the builtin task, with stable prompt ids.

Bad input is found here, before any Ray actor starts, and reported as `ConfigError` with
the field, what is wrong and the fix:

- `iter_chunks` streams a file a chunk of rows at a time, so the one check of a job's inputs
  (pipelines/data/inputs.py, `streamrl validate` and `streamrl run`) reads every row without holding
  the file: a truncated .jsonl, a .parquet with damaged pages, a .json that is not a table or a byte
  that is not UTF-8 is named with the file, the line and the fix.
- `load_prompts` reads the whole file (the table a job schedules), with the same messages.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import numpy as np
import pandas as pd
import pyarrow.parquet as pq

from pipelines.config.base import ConfigError
from pipelines.config.data import BUILTIN_DATASET_PREFIX, BUILTIN_DATASET_SPLITS, DataConfig

FILE_FIX = "repair the file or export it again (an interrupted copy or download leaves it cut short)"
CHUNK_ROWS = 8192  # rows read at a time when a file is streamed (iter_chunks)


class DatasetError(ValueError):
    """A dataset file cannot be read; the message names the file, what is wrong and the fix."""


def read_columns(file: Path) -> list[str]:
    """Column names of a dataset file, reading as little as the format allows."""
    if file.suffix == ".parquet":
        try:
            return list(pq.read_schema(file).names)
        except Exception as err:  # noqa: BLE001 - pyarrow raises several types; all mean unreadable
            raise DatasetError(f"cannot read {str(file)!r} ({type(err).__name__}: {_one_line(err)}); {FILE_FIX}") from None
    return list(_read_frame(file, nrows=5).columns)


class MappingError(DatasetError):
    """A column of data.columns cannot be made: `column` names which."""

    def __init__(self, column: str, message: str):
        super().__init__(message)
        self.column = column


# verl's parquet layout keeps the answer in a record column; a file in that layout gets `ground_truth` unasked.
VERL_MAPPING = {"ground_truth": "reward_model.ground_truth"}


def column_mapping(columns: list[str], mapping: dict[str, str]) -> dict[str, str]:
    """data.columns, plus `ground_truth` from `reward_model.ground_truth` for a file in verl's layout (it has a
    `reward_model` column and no `ground_truth` one, and data.columns does not say otherwise)."""
    if "reward_model" in columns and "ground_truth" not in {*columns, *mapping}:
        return {**VERL_MAPPING, **mapping}
    return mapping


def with_mapped_columns(frame: pd.DataFrame, mapping: dict[str, str], path: str, first_row: int = 0) -> pd.DataFrame:
    """`frame` with the columns of data.columns added (and verl's, `column_mapping`), {new: source}: a column, or a
    dotted path into a column of records (a parquet struct, a JSON object). Raises MappingError naming the column,
    the row and the fix."""
    mapping = column_mapping(list(frame.columns), mapping)
    if not mapping:
        return frame
    frame = frame.copy()
    for new, source in mapping.items():
        root, *fields = source.split(".")
        if root not in frame.columns:
            raise MappingError(new, f"{path!r} has no column {root!r} for {new!r} ({source!r}); its columns are "
                               f"{list(frame.columns)}; fix the source")
        values = frame[root].tolist()
        for depth, name in enumerate(fields):
            inner = ".".join([root, *fields[:depth]])
            for row, value in enumerate(values):
                if value is not None and not (isinstance(value, dict) and name in value):
                    what = (f"a record without {name!r} (it has {sorted(value)})" if isinstance(value, dict)
                            else f"{type(value).__name__}, not a record")
                    raise MappingError(new, f"{path!r} row {first_row + row}: {inner!r} is {what}, so {source!r} "
                                       f"cannot make column {new!r}; fix the source")
            values = [None if value is None else value[name] for value in values]
        frame[new] = values
    return frame


def read_source_columns(path: str, data: DataConfig | None, where: str = "data") -> list[str]:
    """Column names of an hf:NAME dataset or a save_to_disk folder (pipelines/data/hf_datasets.py)."""
    from pipelines.data import hf_datasets

    config, split = (data.hf_config, data.hf_split) if data is not None else (None, "train")
    try:
        return hf_datasets.read_columns(path, config, split, where)
    except hf_datasets.HfDatasetError as err:
        raise DatasetError(str(err)) from None


def data_chunks(data: DataConfig, where: str = "data", chunk_rows: int = CHUNK_ROWS) -> Iterator[pd.DataFrame]:
    """The rows of the dataset a section names, in order, a chunk at a time: `iter_chunks` of its file, or of its
    hf:NAME dataset or save_to_disk folder. Raises DatasetError."""
    from pipelines.data import hf_datasets

    if not hf_datasets.is_hf_source(data.path):
        yield from iter_chunks(Path(data.path), chunk_rows)
        return
    try:
        yield from hf_datasets.iter_chunks(data.path, data.hf_config, data.hf_split, chunk_rows, where)
    except hf_datasets.HfDatasetError as err:
        raise DatasetError(str(err)) from None


def _data_frame(data: DataConfig) -> pd.DataFrame:
    """The whole dataset a section names (a file, an hf:NAME dataset or a save_to_disk folder)."""
    from pipelines.data import hf_datasets

    if not hf_datasets.is_hf_source(data.path):
        return _read_frame(Path(data.path))
    try:
        return hf_datasets.read_frame(data.path, data.hf_config, data.hf_split)
    except hf_datasets.HfDatasetError as err:
        raise DatasetError(str(err)) from None


def _one_line(err: Exception) -> str:
    return " ".join(str(err).split())


def _read_frame(file: Path, nrows: int | None = None) -> pd.DataFrame:
    """The file as a table (the first `nrows` rows, where the format allows). Raises DatasetError."""
    try:
        if file.suffix == ".parquet":
            # Checks page checksums where the writer stored them; damaged compressed pages fail anyway.
            return pd.read_parquet(file, page_checksum_verification=True)
        if file.suffix == ".csv":
            return pd.read_csv(file, nrows=nrows)
        if file.suffix == ".jsonl":
            return pd.read_json(file, lines=True, nrows=nrows)
        return _read_json(file)
    except DatasetError:
        raise
    except Exception as err:  # noqa: BLE001 - pandas/pyarrow raise many types; all mean unreadable
        raise _unreadable(file, err, nrows) from None


def iter_chunks(file: Path, chunk_rows: int = CHUNK_ROWS) -> Iterator[pd.DataFrame]:
    """The file's rows in order, `chunk_rows` at a time (a .json file, one document, all at once), each chunk a
    table read as `load_prompts` reads the file; only one chunk is held. Raises DatasetError (the file, the
    line where the format has lines, the fix) at the first chunk that cannot be read."""
    try:
        if file.suffix == ".parquet":
            parquet = pq.ParquetFile(file, page_checksum_verification=True)
            for batch in parquet.iter_batches(batch_size=chunk_rows):
                yield batch.to_pandas()
        elif file.suffix in (".csv", ".jsonl"):
            reader = (pd.read_csv(file, chunksize=chunk_rows) if file.suffix == ".csv"
                      else pd.read_json(file, lines=True, chunksize=chunk_rows))
            with reader:
                yield from reader
        else:
            yield _read_json(file)
    except DatasetError:
        raise
    except Exception as err:  # noqa: BLE001 - pandas/pyarrow raise many types; all mean unreadable
        raise _unreadable(file, err) from None


def _unreadable(file: Path, err: Exception, nrows: int | None = None) -> DatasetError:
    """What cannot be read, where and the fix. pandas names no line: the first bad one is looked for here
    (only on this failure path)."""
    problem = _first_bad_jsonl_line(file, nrows) if file.suffix == ".jsonl" else None
    if problem is None and isinstance(err, UnicodeDecodeError):
        problem = _first_non_utf8_line(file)
    if problem is None:
        return DatasetError(f"cannot read {str(file)!r} ({type(err).__name__}: {_one_line(err)}); {FILE_FIX}")
    fix = encoding_fix(file) if "not UTF-8" in problem else FILE_FIX
    return DatasetError(f"cannot read {str(file)!r}: {problem}; {fix}")


def encoding_fix(file: Path) -> str:
    return (f"save it as UTF-8 text (from Latin-1: `iconv -f latin1 -t utf-8 {file.name} > utf8{file.suffix}`; "
            "from Excel: save as 'CSV UTF-8')")


def _not_utf8(number: int, raw: bytes) -> str | None:
    """'line N is not UTF-8 text (...)' when the line's bytes do not decode, else None."""
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as err:
        return (f"line {number} is not UTF-8 text (byte 0x{raw[err.start]:02x} at column {err.start + 1}: "
                f"{err.reason})")
    return None


def _first_non_utf8_line(file: Path) -> str | None:
    with open(file, "rb") as handle:
        return next((found for number, raw in enumerate(handle, start=1) if (found := _not_utf8(number, raw))), None)


def _first_bad_jsonl_line(file: Path, nrows: int | None) -> str | None:
    """'line N ...' for the first line that is not a JSON object, or None if every line is one."""
    records = 0
    with open(file, "rb") as handle:
        for number, raw in enumerate(handle, start=1):
            encoding = _not_utf8(number, raw)
            if encoding:
                return encoding
            text = raw.decode("utf-8")
            if not text.strip():
                continue
            try:
                value = json.loads(text)
            except json.JSONDecodeError as err:
                last = not raw.endswith(b"\n")
                hint = "; the file ends inside this line: truncated?" if last else " (truncated or corrupt?)"
                return f"line {number} is not valid JSON ({err.msg} at column {err.colno}){hint}"
            if not isinstance(value, dict):
                return f"line {number} is a JSON {type(value).__name__}, not an object like {{\"prompt\": ...}}"
            records += 1
            if nrows is not None and records >= nrows:
                break
    return None


def _read_json(file: Path) -> pd.DataFrame:
    text = file.read_text(encoding="utf-8")
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise DatasetError(
            f"cannot read {str(file)!r}: not valid JSON at line {err.lineno} column {err.colno} ({err.msg}); "
            f"{FILE_FIX}"
        ) from None
    layout = "a list of records like [{\"prompt\": ...}, ...] (or use .jsonl, one object per line)"
    if isinstance(value, list):
        bad = next((index for index, item in enumerate(value) if not isinstance(item, dict)), None)
        if bad is not None:
            raise DatasetError(
                f"cannot read {str(file)!r}: item {bad} of the list is a JSON {type(value[bad]).__name__}, "
                f"not an object; the file must hold {layout}"
            )
    elif not (isinstance(value, dict) and value and all(isinstance(v, (dict, list)) for v in value.values())):
        # pandas' own column layout ({"prompt": {"0": ...}}, what DataFrame.to_json writes) is accepted too.
        raise DatasetError(f"cannot read {str(file)!r}: it is a JSON {type(value).__name__}, not {layout}")
    from io import StringIO

    return pd.read_json(StringIO(text))  # pandas reads the table as it always has (same dtypes, same ids)


def made_prompts(data: DataConfig) -> pd.DataFrame | None:
    """The table of a dataset streamrl makes itself (builtin:<name>, reasoning_gym:<task>, with `prompt_id` and
    `prompt`), None for a file. Raises `ConfigError` for a task that cannot be made."""
    from pipelines.data.reasoning_tasks import REASONING_GYM_PREFIX

    if data.path.startswith(REASONING_GYM_PREFIX):  # a reasoning-gym task's split (pipelines/data/reasoning_tasks.py)
        from pipelines.data.reasoning_tasks import TaskError, make_task_dataset, task_name

        try:
            return make_task_dataset(task_name(data.path), data.num_prompts, seed=data.seed, split=data.split,
                                     task_options=data.task_options)
        except TaskError as err:
            raise ConfigError(err.problems, data.path) from None
    if not data.path.startswith(BUILTIN_DATASET_PREFIX):
        return None
    name = data.path[len(BUILTIN_DATASET_PREFIX):]
    split = BUILTIN_DATASET_SPLITS[name]
    if name.startswith("tools"):  # the tiny tool task's two-digit sums
        from pipelines.data.tiny_tools import make_tool_dataset

        return make_tool_dataset(data.num_prompts, seed=data.seed, split=split)
    from pipelines.data.tiny import make_arithmetic_dataset

    return make_arithmetic_dataset(data.num_prompts, seed=data.seed, split=split)


def load_prompts(data: DataConfig) -> tuple[pd.DataFrame, str]:
    """The prompt table (columns `prompt_id`, `prompt`, plus the dataset's own) and its source.

    Reads the whole file; raises `ConfigError` on `data.path` if it cannot be read. The rows are not checked
    here: the one check of a job's inputs (pipelines/data/inputs.py) streams them all before, and
    `validate_prompts` checks a table already read (the held-out prompts)."""
    made = made_prompts(data)
    if made is not None:
        return made, data.path
    try:
        frame = with_mapped_columns(_data_frame(data), data.columns, data.path)
    except MappingError as err:
        raise ConfigError([(f"data.columns.{err.column}", str(err))], data.path) from None
    except DatasetError as err:
        raise ConfigError([("data.path", str(err))], data.path) from None
    missing = [c for c in (data.prompt_column, data.id_column) if c is not None and c not in frame.columns]
    if missing:  # the config was validated against another file, or the file changed since
        message = (f"{data.path!r} has no column {missing[0]!r}; its columns are {list(frame.columns)}; "
                   "fix data.prompt_column / data.id_column")
        raise ConfigError([("data.path", message)], data.path)
    problems = column_problems(list(frame.columns), data.prompt_column, data.id_column, data.path)
    if problems:
        raise ConfigError(problems, data.path)
    ids = frame[data.id_column] if data.id_column else None
    frame = frame.rename(columns={data.prompt_column: "prompt"})
    if ids is not None:
        frame["prompt_id"] = [id_text(value) for value in ids]
    else:
        frame["prompt_id"] = [f"row-{index:08d}" for index in range(len(frame))]
    return frame.reset_index(drop=True), data.path


# Columns streamrl adds to every prompt row on its way through the DAG (the prompt's id, its place in the
# schedule, what the stages produce): a dataset column of one of these names would be overwritten.
RESERVED_COLUMNS = ("prompt_id", "epoch", "train_step", "group_uid", "policy_version", "prompt_text",
                    "prompt_token_ids", "responses", "response_token_ids", "response_lengths", "behavior_logprobs",
                    "rewards", "advantages", "returns", "values", "loss_masks", "turns", "ref_logprobs")


def column_problems(columns: list[str], prompt_column: str, id_column: str | None,
                    path: str, where: str = "data") -> list[tuple[str, str]]:
    """A dataset's columns that would collide with streamrl's: a `prompt` column beside another
    prompt_column (streamrl renames the prompt column to `prompt`), and the reserved names."""
    problems = []
    if prompt_column != "prompt" and "prompt" in columns:
        problems.append((f"{where}.prompt_column", f"{path!r} has a column 'prompt' besides the prompt column "
                         f"{prompt_column!r}, and streamrl names the prompt column 'prompt'; rename or drop that "
                         "column, or set prompt_column: prompt"))
    reserved = [c for c in columns if c in RESERVED_COLUMNS and c != id_column]
    if reserved:
        problems.append((f"{where}.path", f"{path!r} has columns streamrl adds to every row itself: {reserved} "
                         "(they would be overwritten); rename them (e.g. with a 'data_' prefix)"
                         + (f"; if 'prompt_id' holds the prompts' ids, set {where}.id_column: prompt_id"
                            if "prompt_id" in reserved else "")))
    return problems


def id_text(value) -> str:
    """A prompt id as text; a missing id becomes '' (reported as an empty id)."""
    if value is None or (isinstance(value, float) and np.isnan(value)) or value is pd.NA:
        return ""
    return str(value)
