"""Rewards: the reward functions and their actors (`reward`), and the sandbox the functions and the tools of
multi-turn episodes run in (`sandbox`; its operators.environments.sandbox.SandboxLimits are built in
pipelines/runtime/rollout_settings.py). Whether each function can be imported is checked through
pipelines/config/world.py's WorldChecks, in the same pass as every other field."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, ValidationInfo, field_validator

from pipelines.config.base import Section, world_checks


class RewardFunctionConfig(Section):
    name: str = Field(
        description="A builtin reward name (see operators.stages.reward.REWARD_FUNCTIONS) or 'module:function' "
        "with signature (completions, **dataset_columns) -> list[float], or one written for TRL's GRPOTrainer "
        "(prompts, completions, completion_ids, **dataset_columns); `async def` works too."
    )
    weight: float = Field(1.0, description="Weight of this function in the summed reward.")
    style: Literal["auto", "streamrl", "trl"] = Field(
        "auto", description="How the function is called (operators/stages/reward_calls.py). streamrl: "
        "completions as text, None = could not score (on_error). trl: TRL's convention: prompts as the dataset "
        "holds them, completions as messages when the prompt is a list of messages, completion_ids, every "
        "column but the prompt; None = does not apply (adds nothing, no error). auto: trl when the function "
        "takes `prompts` or `completion_ids`, else streamrl."
    )

    @field_validator("name")
    @classmethod
    def _importable(cls, name: str, info: ValidationInfo) -> str:
        return world_checks(info).reward_function(name)


class RewardConfig(Section):
    functions: list[RewardFunctionConfig] = Field(
        default_factory=lambda: [RewardFunctionConfig(name="arithmetic_exact")],
        description="Reward functions, summed with their weights. Empty only with rollout.environment, whose own "
        "rewards (an environment's, or what an agent returns) are then the reward.",
    )
    on_error: float = Field(
        0.0, description="Reward given to a sample whose reward function raised or returned None (a trl-style "
        "function's None means 'does not apply' instead)."
    )
    stop_after_failed_steps: int = Field(
        1, ge=1, description="Stop the job when a reward function raises on every sample of this many train steps "
        "in a row; the terminal names the function and its exception. 1: the first such step stops the job, before "
        "it trains (every sample would have trained on on_error alone); more: the steps before it train on "
        "on_error, each with a warning."
    )
    success_threshold: float = Field(
        1.0, description="A sample whose summed reward is at least this counts as a success (success_rate)."
    )
    placement: Literal["stage", "generate"] = Field(
        "stage", description="Where rewards are computed: stage (an actor pool of its own, num_actors x "
        "num_cpus; for costly rewards) or generate (in the generate actor that sampled the group, right after "
        "it: one Ray Data hop less per loop, for cheap rewards; num_actors and num_cpus are then unused)."
    )
    num_actors: int = Field(1, ge=1, description="Reward actors in the pool (placement: stage).")
    num_cpus: float = Field(0.1, gt=0, description="CPUs reserved per reward actor (placement: stage).")
    timeout_s: float = Field(
        60, ge=0, description="Seconds one reward function call (one batch) may take. With a limit, functions run "
        "in a child process of the reward actor, killed and replaced when a call runs over; that batch's samples "
        "get on_error and count in reward_timeouts. 0: no limit, functions run in the actor itself."
    )

    def function_specs(self) -> list[tuple[str, float, str]]:
        """(name, weight, style) per function: what operators.stages.reward.Reward takes."""
        return [(f.name, f.weight, f.style) for f in self.functions]


class SandboxConfig(Section):
    """What the sandbox child of reward functions (reward.timeout_s > 0) and tool calls may use
    (operators/environments/sandbox.py). A limit of 0 is no limit."""

    memory_mb: int = Field(4096, ge=0, description="Address space of a sandbox child, MiB; a function that "
                           "allocates past it fails that call (on_error, or an error observation for a tool).")
    cpu_seconds: int = Field(3600, ge=0, description="CPU seconds over a child's life; the child is replaced "
                             "at half of it, so only a runaway call meets the limit.")
    file_size_mb: int = Field(64, ge=0, description="Largest file a child may write, MiB.")
    max_processes: int = Field(128, ge=0, description="Processes and threads of a child, where it runs in its "
                               "own user namespace (see network); elsewhere the kernel would count every process "
                               "of the job's user, so it is not set.")
    max_reply_mb: float = Field(8, gt=0, description="Largest reply (scores, a tool's result) a child may send, "
                                "MiB, as JSON; a larger one fails that call.")
    network: bool = Field(False, description="Let the functions reach the network (say, an LLM judge's API). "
                          "false: each child runs in its own network namespace where `unshare -rn` is permitted "
                          "(no interface, loopback down; said once at start-up either way).")
    pass_env: list[str] = Field(default_factory=list, description="Environment variables a child keeps beyond "
                                "PATH, HOME, locale, TZ, PYTHONPATH and the like, e.g. [JUDGE_API_KEY]; every "
                                "other variable (credentials) is dropped.")
