"""The simulated engine's and trainer's parameters: `CostModel` and its response-length model.

Read by the simulated engine (benchmarks/sim_engine.py, which says what each cost stands for), the
simulated trainer (benchmarks/sim_trainer.py) and the simulation's planning and bound
(benchmarks/sim_layout.py, sim_bound.py, sim_tiers.py). A cost model travels as a JSON file: the
engines' `model_path`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class LengthModel:
    """Response lengths in simulated tokens: lognormal(log(median), sigma), capped at `cap`."""

    median: float = 1000.0
    sigma: float = 1.0
    cap: int = 16384

    def draw(self, rng: np.random.Generator, size: int) -> np.ndarray:
        lengths = np.ceil(rng.lognormal(math.log(self.median), self.sigma, size))
        return np.clip(lengths, 1, self.cap).astype(np.int64)


@dataclass(frozen=True)
class CostModel:
    """Every parameter of the simulated engine (and of the simulated trainer, `train_*`)."""

    time_scale: float = 100.0  # simulated seconds per real second
    token_unit: int = 64  # simulated tokens per fake token id
    prompt_tokens: int = 256  # simulated prompt length (enters the trainer's token count)
    gpus_per_instance: int = 1
    instances: int = 1  # engine instances this actor stands for
    decode_step_s: float = 0.020  # per tick, independent of the batch
    decode_per_seq_s: float = 6e-5  # per tick, per active sequence
    max_num_seqs: int = 256  # active sequences per instance
    weight_sync_s: float = 3.0  # decoding stalled while new weights load
    length: LengthModel = field(default_factory=LengthModel)
    length_seed: int = 0
    train_seconds_per_token: float = 1.5e-4  # GPU-seconds per trained token
    train_step_fixed_s: float = 3.0  # optimizer step, gradient sync
    train_gpus: int = 1
    stats_dir: str | None = None  # not a cost: where engines record utilisation and update stalls

    @classmethod
    def from_dict(cls, values: Mapping) -> CostModel:
        values = dict(values)
        values["length"] = LengthModel(**values.get("length", {}))
        unknown = set(values) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown cost-model fields {sorted(unknown)}; known: {sorted(cls.__dataclass_fields__)}")
        return cls(**values)

    @classmethod
    def load(cls, path: str | Path) -> CostModel:
        return cls.from_dict(json.loads(Path(path).read_text()))

    def to_dict(self) -> dict:
        return asdict(self)

    def tick_seconds(self, active: int) -> float:
        """Simulated seconds of one decode tick with `active` sequences."""
        return self.decode_step_s + self.decode_per_seq_s * active

    def ids(self, tokens: int) -> int:
        """Fake ids of a response of `tokens` simulated tokens."""
        return math.ceil(tokens / self.token_unit)
