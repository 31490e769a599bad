"""Prompt datasets: read a file or build the builtin task, with stable prompt ids."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq

from pipelines.config import BUILTIN_DATASET_PREFIX, DataConfig


def read_columns(file: Path) -> list[str]:
    """Column names of a dataset file, reading as little as the format allows."""
    if file.suffix == ".parquet":
        return list(pq.read_schema(file).names)
    return list(_read_frame(file, nrows=5).columns)


def _read_frame(file: Path, nrows: int | None = None) -> pd.DataFrame:
    if file.suffix == ".parquet":
        return pd.read_parquet(file)
    if file.suffix == ".csv":
        return pd.read_csv(file, nrows=nrows)
    if file.suffix == ".jsonl":
        return pd.read_json(file, lines=True, nrows=nrows)
    return pd.read_json(file)


def load_prompts(data: DataConfig) -> tuple[pd.DataFrame, str]:
    """The prompt table (columns `prompt_id`, `prompt`, plus the dataset's own) and its source."""
    if data.path.startswith(BUILTIN_DATASET_PREFIX):
        from pipelines.tiny import make_arithmetic_dataset

        return make_arithmetic_dataset(data.num_prompts, seed=data.seed), data.path
    frame = _read_frame(Path(data.path))
    frame = frame.rename(columns={data.prompt_column: "prompt"})
    if data.id_column:
        frame["prompt_id"] = frame[data.id_column].astype(str)
    else:
        frame["prompt_id"] = [f"row-{index:08d}" for index in range(len(frame))]
    return frame.reset_index(drop=True), data.path
