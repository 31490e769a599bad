"""Which policy versions a training job evaluates on held-out prompts, across its attempts
(the evaluator itself: pipelines/evaluation/in_training.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pandas as pd

from pipelines.config.job import JobConfig
from pipelines.evaluation.in_training import InTrainingEval
from pipelines.stages import engine_options


class EvalPlan:
    """Which policy versions the job evaluates on held-out prompts, and what was logged, across attempts."""

    def __init__(self, cfg: JobConfig, prompts: pd.DataFrame | None, model_path: str, tracker, artifacts_dir: Path,
                 log=None):
        """`log`: where evaluations are logged (an EvalRows of the job's StepLog; default `tracker`)."""
        self.cfg, self.prompts, self.model_path, self.tracker = cfg, prompts, model_path, tracker
        self.log = log or tracker
        self.artifacts_dir = artifacts_dir
        self.rows: list[dict] = []  # one per evaluated version, in order
        # A resumed run: the versions its earlier processes evaluated are in MLflow already.
        self.logged = tracker.metric_steps("eval/policy_version") if tracker.resumed and prompts is not None else set()

    def versions(self, first_step: int) -> list[int]:
        """Versions still to evaluate in an attempt that starts at `first_step` (a restart or a resume
        redoes none that was logged)."""
        if self.prompts is None:
            return []
        done = {row["step"] for row in self.rows} | self.logged
        return [v for v in self.cfg.eval.versions(self.cfg.train.steps) if v >= first_step and v not in done]

    def start(self, store, first_step: int, echo: Callable[[str], None]) -> InTrainingEval | None:
        versions = self.versions(first_step)
        if not versions:
            return None
        options = engine_options(self.cfg, self.cfg.eval.engine)
        return InTrainingEval(self.cfg, self.prompts, self.model_path, options, store,
                              versions, self.log, echo, self.rows, self.artifacts_dir)

    def forget_after(self, step: int) -> None:
        """A restart from the checkpoint of `step` steps: the versions after it are other weights now,
        evaluated again."""
        self.rows[:] = [row for row in self.rows if row["step"] <= step]

    def table(self) -> pd.DataFrame:
        return pd.DataFrame(self.rows)
