"""Dataset values as plain Python, for JSON and for code that expects Python's own types."""

from __future__ import annotations

from typing import Any, Callable

import pandas as pd


def plain(value: Any, otherwise: Callable[[Any], Any] = lambda value: value) -> Any:
    """`value` as plain Python: numpy arrays become lists, numpy (and other array-library) scalars
    numbers, pandas' NA None; any other value goes through `otherwise` (unchanged by default; `str`
    as `json.dumps`'s `default=`, which only sees values JSON cannot write)."""
    if value is pd.NA:
        return None
    if hasattr(value, "tolist"):
        return value.tolist()
    if hasattr(value, "item"):
        return value.item()
    return otherwise(value)
