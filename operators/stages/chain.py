"""Several operators in one Ray Data stage: one actor runs them one after another on each block.

Every stage boundary of the RL DAG costs a trip through Ray Data's streaming executor (the
upstream task ends, the scheduling loop notices it, dispatches a task to the next actor, which
converts the block back into a batch). On a small model that trip costs far more than the
operators' compute (benchmarks/loop_latency.py measures it per hop), and it is on the critical
path of every policy version: train -> publish -> generate -> ... -> train. Fusing cheap stages
removes those trips; each operator stays a plain callable class that any Ray Data job can use on
its own.

    ds.map_batches(Chain, fn_constructor_kwargs={"stages": [(Advantage, {...}), (Train, {...})]},
                   compute=ActorPoolStrategy(size=1), batch_size=None, batch_format="pandas")

An operator may return a batch or yield several (Train yields a metrics row per finished
step, or nothing); each batch it produces goes through the rest of the chain.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Sequence

import pandas as pd


class Chain:
    def __init__(self, stages: Sequence[tuple[type, dict[str, Any]]]):
        """`stages`: (operator class, its constructor kwargs), in the order they run."""
        if not stages:
            raise ValueError("a Chain needs at least one stage")
        self.stages = [cls(**kwargs) for cls, kwargs in stages]

    def __call__(self, batch: pd.DataFrame) -> Iterator[pd.DataFrame]:
        yield from self._run(0, batch)

    def _run(self, index: int, batch: pd.DataFrame) -> Iterator[pd.DataFrame]:
        if index == len(self.stages):
            yield batch
            return
        out = self.stages[index](batch)
        for part in (out if isinstance(out, Iterator) else (out,)):
            yield from self._run(index + 1, part)

    def close(self) -> None:
        """Close the stages that hold resources (an engine, a reward sandbox), in order, each once."""
        stages, self.stages = self.stages, []
        for stage in stages:
            close = getattr(stage, "close", None)
            if callable(close):
                close()

    def __del__(self):
        # Ray Data drops its map actor's callable when it ends the actor (its input ran out, or the pool shrank):
        # the stages close then, in order (a generate engine leaves the weight plane before it shuts down)
        try:
            self.close()
        except Exception:
            pass
