"""Prompt datasets kept the way `datasets` users keep them: a dataset by name (`data.path: hf:NAME`, with
`data.hf_config` and `data.hf_split`) loaded with `datasets.load_dataset`, from the Hugging Face cache
(HF_HOME / HF_DATASETS_CACHE) when HF_HUB_OFFLINE=1 (as Hub ids of models are) and else from the Hub once, and a
folder written by `save_to_disk` (a Dataset, or a DatasetDict whose split `data.hf_split` picks), loaded with
`datasets.load_from_disk`. Both are memory-mapped Arrow: the rows are streamed to the checks a chunk at a time
(`iter_chunks`) and converted as parquet rows are (records become dicts, lists become arrays).

Every failure is an HfDatasetError naming the dataset, what is wrong and the fix (pipelines/data/datasets.py
reports it as any other unreadable dataset). `datasets` is imported only when such a dataset is named.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator

import pandas as pd

HF_PREFIX = "hf:"
SAVED_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")


class HfDatasetError(ValueError):
    """A dataset by name or a saved folder cannot be loaded; the message says why and the fix."""


def _one_line(err: Exception) -> str:
    return " ".join(str(err).split())


def is_hf_source(path: str) -> bool:
    """A dataset by name (hf:NAME) or a folder written by `save_to_disk`."""
    if path.startswith(HF_PREFIX):
        return True
    folder = Path(path).expanduser()
    return folder.is_dir() and any((folder / marker).is_file() for marker in SAVED_MARKERS)


@contextlib.contextmanager
def _quiet():
    """No progress bars or cache notices from `datasets` on the user's terminal (streamrl says what it read)."""
    import datasets

    bars = datasets.utils.logging.is_progress_bar_enabled()
    level = datasets.utils.logging.get_verbosity()
    datasets.utils.logging.disable_progress_bar()
    datasets.utils.logging.set_verbosity_error()
    try:
        yield
    finally:
        datasets.utils.logging.set_verbosity(level)
        if bars:
            datasets.utils.logging.enable_progress_bar()


def load(path: str, config: str | None, split: str, where: str = "data"):
    """The `datasets.Dataset` a data section names. Raises HfDatasetError."""
    try:
        import datasets
    except ImportError:
        raise HfDatasetError(f"{path!r} needs the `datasets` package; install streamrl with `make install`") from None
    with _quiet():
        if path.startswith(HF_PREFIX):
            name = path[len(HF_PREFIX):]
            try:
                return datasets.load_dataset(name, config, split=split)
            except ValueError as err:  # an unknown split or config: the message lists the known ones
                raise HfDatasetError(f"cannot load {name!r} (config {config!r}, split {split!r}): {_one_line(err)}; "
                                     f"fix {where}.hf_config / {where}.hf_split") from None
            except Exception as err:  # noqa: BLE001 - not cached, unreachable, damaged: all mean not loadable
                raise HfDatasetError(
                    f"cannot load {name!r} ({type(err).__name__}: {_one_line(err)}); with HF_HUB_OFFLINE=1 it must be "
                    f"in the Hugging Face cache: load it once while online (`datasets.load_dataset({name!r}"
                    f"{', ' + repr(config) if config else ''})`), or give a file or a `save_to_disk` folder") from None
        try:
            loaded = datasets.load_from_disk(str(Path(path).expanduser()))
        except Exception as err:  # noqa: BLE001
            raise HfDatasetError(f"cannot load the saved dataset {path!r} ({type(err).__name__}: {_one_line(err)}); "
                                 "save it again with `save_to_disk`") from None
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise HfDatasetError(f"{path!r} holds the splits {sorted(loaded)}, not {split!r}; set {where}.hf_split")
        return loaded[split]
    return loaded


def read_columns(path: str, config: str | None, split: str, where: str = "data") -> list[str]:
    return list(load(path, config, split, where).column_names)


def iter_chunks(path: str, config: str | None, split: str, chunk_rows: int, where: str = "data") -> Iterator[pd.DataFrame]:
    """The rows in order, `chunk_rows` at a time, each a table as a parquet file's rows read."""
    dataset = load(path, config, split, where)
    table = dataset.with_format("arrow")
    for start in range(0, len(dataset), chunk_rows):
        yield table[start:start + chunk_rows].to_pandas()


def read_frame(path: str, config: str | None, split: str, where: str = "data") -> pd.DataFrame:
    return load(path, config, split, where).with_format("arrow")[:].to_pandas()
