"""Held-out evaluation during training (`eval`): which policy versions, how many samples, the evaluator's
engine and resources. Whether its engine is installed is checked through pipelines/config/world.py's
WorldChecks, as rollout.engine is."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field, ValidationInfo, field_validator, model_validator

from pipelines.config.base import CustomResources, GpuCount, Section, raise_at, world_checks
from pipelines.config.data import EvalDataConfig


class EvalConfig(Section):
    data: EvalDataConfig = Field(description="The held-out prompts (a dataset like `data`).")
    every: int = Field(
        10, ge=0, description="Evaluate the policy every this many steps (policy versions every, 2*every, ...) and "
        "after the last step; 0: only after the last step."
    )
    at_start: bool = Field(True, description="Also evaluate the starting policy (version 0) before it is trained.")
    n: int = Field(8, ge=0, description="Sampled responses per prompt (pass@k is reported for k = 1, 2, 4, ... <= n "
                   "and k = n); 0: greedy only.")
    greedy: bool = Field(True, description="Also decode one greedy (temperature 0) response per prompt.")
    temperature: Optional[float] = Field(
        None, gt=0, description="Sampling temperature of the n samples; default rollout.temperature."
    )
    max_new_tokens: Optional[int] = Field(None, ge=1, description="Default rollout.max_new_tokens.")
    max_prompts: int = Field(256, ge=1, description="Evaluate at most this many prompts (the dataset's first).")
    prompts_per_call: int = Field(16, ge=1, description="Prompts per generate call of the evaluator.")
    engine: Optional[Literal["hf", "vllm"]] = Field(
        None, description="The evaluator's engine; default rollout.engine (with its rollout.vllm settings)."
    )
    nice: int = Field(
        10, ge=0, le=19, description="How much lower the evaluator's CPU priority is than the job's other actors "
        "(a niceness added to Ray's worker niceness, 15 by default, up to 19; its engine's processes inherit it): "
        "on cores it shares with the job, the trainer and the generators go first and evaluation takes what they "
        "leave (0: equal footing). Its actor and engine also start only after the first step is trained."
    )
    num_cpus: float = Field(0.25, gt=0, description="CPUs reserved for the evaluator actor.")
    num_gpus: GpuCount = Field(0, description="GPUs reserved for the evaluator actor (its own engine).")
    resources: CustomResources = Field(default_factory=dict, description="Custom Ray resources of the evaluator.")
    log_samples: bool = Field(True, description="Log every evaluation's scored responses as a Parquet artifact "
                              "(eval/step_NNNNNN.parquet).")

    @field_validator("engine")
    @classmethod
    def _eval_engine_installed(cls, engine: str | None, info: ValidationInfo) -> str | None:
        return engine if engine is None else world_checks(info).engine(engine)

    @model_validator(mode="after")
    def _evaluates_something(self) -> "EvalConfig":
        if self.n == 0 and not self.greedy:
            raise_at(["eval.n: n: 0 with greedy: false evaluates nothing; set n >= 1 or greedy: true"])
        return self

    def versions(self, steps: int) -> list[int]:
        """The policy versions evaluated in a job of `steps` steps, in order."""
        every = range(self.every, steps, self.every) if self.every else []
        return ([0] if self.at_start else []) + list(every) + [steps]
