"""The job's config, assembled from its sections (one module each under pipelines/config/), and the rules
between sections: a step's groups, samples and ranks that must divide, the length budget, the reference the
KL terms need, the critic the estimator needs, the evaluator's engine and the weight transfer against the
devices. Every problem is listed at its own field path (CrossFieldProblems), in one pass.

A config is YAML. Every field has a description and a default; unknown keys are errors. `load_config`
(pipelines/config/load.py) returns a `JobConfig` or raises `ConfigError`, whose message lists every problem
with its field path and the fix, so a user fixes the file in one pass. Reading files and `--set` overrides
are load.py's; what a config names in the world (dataset files, models, reward functions, environments,
registered algorithm names, the cluster) is pipelines/config/world.py's, which gives the sections their checks
through pydantic's validation context (pipelines/config/base.py: WorldChecks).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from pydantic import Field, ValidationInfo, model_validator

from pipelines.config.algorithm import AlgorithmConfig
from pipelines.config.base import Section, raise_at, world_checks
from pipelines.config.cluster import RayConfig
from pipelines.config.data import DataConfig
from pipelines.config.evaluation import EvalConfig
from pipelines.config.model import CriticConfig, ModelConfig, ReferenceConfig
from pipelines.config.reward import RewardConfig, SandboxConfig
from pipelines.config.rollout import RolloutConfig, runs_in_flight
from pipelines.config.tracking import TrackingConfig
from pipelines.config.train import TrainConfig


class JobConfig(Section):
    model: ModelConfig = Field(default_factory=ModelConfig, description="The policy model.")
    data: DataConfig = Field(default_factory=DataConfig, description="The prompt dataset.")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="Generation.")
    reward: RewardConfig = Field(default_factory=RewardConfig, description="Reward functions.")
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig, description="Limits and isolation of the child "
                                   "processes reward functions and tool calls run in.")
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig, description="Advantage and loss.")
    train: TrainConfig = Field(default_factory=TrainConfig, description="The DeepSpeed trainer.")
    tracking: TrackingConfig = Field(default_factory=TrackingConfig, description="MLflow lineage.")
    ray: RayConfig = Field(default_factory=RayConfig, description="The Ray cluster.")
    eval: Optional[EvalConfig] = Field(
        None, description="Held-out evaluation during training, by a separate evaluator actor (unset: none)."
    )
    reference: Optional[ReferenceConfig] = Field(
        None, description="A frozen reference policy: the RefLogprob stage adds its log-probs of every response "
        "token (ref_logprobs) for KL to the reference (algorithm.kl_coef); unset: no reference stage."
    )
    critic: Optional[CriticConfig] = Field(
        None, description="PPO's value model, trained by its own DeepSpeed group (algorithm.advantage: gae; "
        "unset: no critic)."
    )
    output_dir: str = Field("runs", description="Folder for the MLflow database, rollouts and checkpoints.")

    @model_validator(mode="after")
    def _consistent(self, info: ValidationInfo) -> "JobConfig":
        checks, problems = world_checks(info), []
        if self.train.groups_per_step % self.rollout.groups_per_call:
            problems.append(
                f"rollout.groups_per_call: {self.rollout.groups_per_call} does not divide "
                f"train.groups_per_step={self.train.groups_per_step}; pick a divisor so no call spans two steps"
            )
        generated = self.generated_groups_per_step()
        if self.algorithm.dynamic_sampling and generated < self.train.groups_per_step:
            problems.append(
                f"algorithm.dynamic_sampling_groups: {generated} generated groups cannot yield "
                f"train.groups_per_step={self.train.groups_per_step}; generate at least that many (0: twice as many)"
            )
        elif self.algorithm.dynamic_sampling and generated % self.rollout.groups_per_call:
            problems.append(
                f"algorithm.dynamic_sampling_groups: {generated} groups per step is not a multiple of "
                f"rollout.groups_per_call={self.rollout.groups_per_call}; pick a multiple so no call spans two steps"
            )
        samples = self.train.groups_per_step * self.rollout.n
        if samples % self.train.world_size:
            problems.append(
                f"train.world_size: {samples} samples per step (groups_per_step x rollout.n) do not split "
                f"evenly over {self.train.world_size} ranks; pick a world_size that divides {samples}"
            )
        per_rank = samples // self.train.world_size
        if per_rank % self.train.mini_batches and not samples % self.train.world_size:
            divisors = [d for d in range(1, per_rank + 1) if per_rank % d == 0]
            problems.append(
                f"train.mini_batches: {self.train.mini_batches} does not divide the {per_rank} samples per rank "
                f"(groups_per_step x rollout.n / world_size); use one of {divisors}"
            )
        env = self.rollout.environment
        budget = checks.policy_budget(self.rollout.max_new_tokens,
                                      *(() if env is None else (env.max_turns, env.max_episode_tokens)))
        if budget is not None and self.algorithm.overlong_buffer >= budget:
            what = ("rollout.max_new_tokens" if self.rollout.environment is None else
                    "the policy's tokens per episode, min(environment.max_turns x rollout.max_new_tokens, "
                    "environment.max_episode_tokens)")
            problems.append(
                f"algorithm.overlong_buffer: {self.algorithm.overlong_buffer} leaves no length unpunished ({what} = "
                f"{budget}); use a buffer below {budget}, or 0"
            )
        if self.rollout.top_p < 1:
            # The trainer's log-probs are over the full vocabulary; under nucleus sampling the engine's are
            # over the nucleus, so rho = pi_prox / pi_behave would be < 1 on every token for no reason.
            problems.append(
                f"rollout.top_p: {self.rollout.top_p} is not supported for training: the engine's behaviour "
                "log-probs would be over the nucleus and the trainer's over the whole vocabulary, which biases "
                "every importance ratio; use top_p: 1.0 (temperature still applies)"
            )
        if self.reference is not None and self.reference.on_trainer and not self.reference_on_trainer():
            problems.append(
                "reference.on_trainer: the reference is computed on the trainer only with train.lora (its adapters "
                "switched off), a reference that is the policy's base model (reference.model_path unset or "
                "model.path) and algorithm.kl_reward_coef 0; unset reference.on_trainer to keep the RefLogprob stage"
            )
        for coef in ("kl_coef", "kl_reward_coef"):
            if getattr(self.algorithm, coef) > 0 and self.reference is None:
                problems.append(
                    f"algorithm.{coef}: KL to a reference needs the reference log-probs; add a `reference:` "
                    "section (`reference: {}` uses the starting policy) or set the coefficient to 0"
                )
        if self.rollout.n == 1 and checks.group_estimator(self.algorithm.advantage):
            problems.append(
                f"rollout.n: 1 response per prompt gives every response advantage 0 under "
                f"algorithm.advantage {self.algorithm.advantage} (it compares the responses to one prompt), so "
                "nothing would be learned; sample n >= 2 (e.g. 8), or use advantage: gae with a critic"
            )
        problems += self._critic_problems(samples, checks.token_estimator(self.algorithm.advantage))
        problems += self._eval_engine_problems()
        if not self.reward.functions and self.rollout.environment is None:
            problems.append("reward.functions: empty, and no rollout.environment gives rewards of its own; name at "
                            "least one reward function (e.g. [{name: arithmetic_exact}])")
        problems += self._weight_transfer_problems() + self._adapter_problems()
        if self.train.dtype == "bf16" and self.train.zero_stage == 0:
            problems.append("train.dtype: bf16 needs train.zero_stage >= 1 in DeepSpeed; set zero_stage: 1")
        raise_at(problems)
        return self

    def serves_adapters(self) -> bool:
        """Whether the generate engines get each version as its LoRA adapter (rollout.lora_adapters)."""
        from pipelines.config.rollout import runs_in_flight

        possible = self.train.lora is not None and self.rollout.engine == "vllm" and runs_in_flight(self.rollout)
        return possible and self.rollout.lora_adapters is not False

    def _adapter_problems(self) -> list[str]:
        if self.rollout.lora_adapters and not self.serves_adapters():
            return ["rollout.lora_adapters: adapters are served by vLLM's in-flight engine to a train.lora job; set "
                    "train.lora, rollout.engine: vllm and rollout.in_flight: true, or unset rollout.lora_adapters"]
        if not self.serves_adapters():
            return []
        problems = []
        if self.train.lora.r > 512:
            problems.append(f"train.lora.r: {self.train.lora.r} is above the largest LoRA rank vLLM serves (512); "
                            "lower it, or set rollout.lora_adapters: false to send the merged weights")
        if self.rollout.weight_transfer not in ("auto", "object_store"):
            problems.append(f"rollout.weight_transfer: {self.rollout.weight_transfer} moves whole weights; LoRA "
                            "adapters travel on object_store (use auto), or set rollout.lora_adapters: false")
        return problems

    def reference_on_trainer(self) -> bool:
        """Whether the policy ranks compute the reference log-probs themselves, their LoRA adapters switched off
        (reference.on_trainer; otherwise the RefLogprob stage does, when there is a reference)."""
        ref = self.reference
        possible = (ref is not None and self.train.lora is not None and ref.model_path in (None, self.model.path)
                    and self.algorithm.kl_reward_coef == 0)
        return possible and ref.on_trainer is not False

    def generated_groups_per_step(self) -> int:
        """Groups generated (scheduled) per train step: train.groups_per_step, more with dynamic sampling."""
        if not self.algorithm.dynamic_sampling:
            return self.train.groups_per_step
        return self.algorithm.dynamic_sampling_groups or 2 * self.train.groups_per_step

    def _weight_transfer_problems(self) -> list[str]:
        """rollout.weight_transfer against the engine and the devices: nccl on CPU, ipc without a shared GPU,
        gloo where NCCL is there, the plane without vLLM's in-flight engine."""
        asked, rollout = self.rollout.weight_transfer, self.rollout
        field = f"rollout.weight_transfer: {asked}"
        gpus = rollout.num_gpus > 0 and self.train.num_gpus > 0
        if asked == "nccl" and not gpus:
            return [f"{field} broadcasts between GPUs, and this job runs on CPUs (rollout.num_gpus and "
                    "train.num_gpus are 0); use auto (gloo on CPUs)"]
        if asked == "ipc" and not (gpus and 0 < rollout.num_gpus < 1):
            return [f"{field} shares a trainer's GPU memory with an engine on the same GPU, and no engine shares "
                    "one (rollout.num_gpus must be a fraction beside a trainer rank's GPU); use auto"]
        if asked in ("nccl", "ipc"):
            return [f"{field} is not wired yet in this version (no GPU to prove it on); use auto (the object "
                    "store on GPUs)"]
        if asked == "gloo" and gpus:
            return [f"{field} would copy every version through host memory where NCCL is available (rollout and "
                    "train run on GPUs); use auto"]
        if asked == "gloo" and not (rollout.engine == "vllm" and runs_in_flight(rollout)):
            return [f"{field} needs vLLM's in-flight engine (rollout.engine: vllm, in_flight not false); "
                    "use auto (the object store for this engine)"]
        return []

    def _eval_engine_problems(self) -> list[str]:
        """The evaluator's vLLM engine takes rollout.vllm, tensor_parallel_size included, in one plain actor;
        multi-turn episodes are evaluated as they are trained, on an in-flight engine."""
        if self.eval is not None and self.rollout.environment is not None and self.eval.engine == "hf":
            return ["eval.engine: hf cannot run the episodes of rollout.environment (every turn is a request to "
                    "an in-flight engine); leave eval.engine unset (the rollout's vllm) or set it to vllm"]
        tp = self.rollout.vllm.tensor_parallel_size
        if self.eval is None or tp == 1 or (self.eval.engine or self.rollout.engine) != "vllm":
            return []
        if self.eval.num_gpus and self.eval.num_gpus != tp:
            return [f"eval.num_gpus: {self.eval.num_gpus:g} GPU(s) for the evaluator, whose vLLM engine takes "
                    f"rollout.vllm.tensor_parallel_size: {tp}; set eval.num_gpus: {tp}, or eval.engine: hf"]
        return []

    def _critic_problems(self, samples: int, token_level: bool | None) -> list[str]:
        """`token_level`: algorithm.advantage computes advantages from a critic's values (None: not known
        without pipelines/config/world.py's checks; then only the critic's own shape is checked)."""
        if token_level and self.critic is None:
            return [f"algorithm.advantage: {self.algorithm.advantage} computes advantages from a critic's values, "
                    "and the config has no critic section; add one (critic: {lr: 0.001}) or use an outcome "
                    "estimator such as grpo"]
        if self.critic is None:
            return []
        if token_level is False:
            return [f"critic: algorithm.advantage: {self.algorithm.advantage} computes advantages from the rewards "
                    "alone and never reads a value, so the critic would be trained for nothing; use "
                    "algorithm.advantage: gae, or remove the critic section"]
        if self.critic.model_path is None:
            self.critic.model_path = self.model.path
        if samples % self.critic.world_size:
            return [f"critic.world_size: {samples} samples per step (groups_per_step x rollout.n) do not split "
                    f"evenly over {self.critic.world_size} ranks; pick a world_size that divides {samples}"]
        per_rank = samples // self.critic.world_size
        if per_rank % self.train.mini_batches:
            return [f"critic.world_size: the critic takes train.mini_batches={self.train.mini_batches} optimizer "
                    f"steps per pass, which does not divide its {per_rank} samples per rank; pick a world_size "
                    "that leaves a multiple of train.mini_batches per rank"]
        return []

    def prompt_options(self, held_out: bool = False) -> dict[str, Any]:
        """How prompts are rendered (operators.common.prompts.PromptFormat's fields): the training data's, or with
        `held_out` the eval data's, each unset field taken from the training data."""
        options = {"chat_template": self.data.chat_template, "system_prompt": self.data.system_prompt}
        if held_out and self.eval is not None:
            own = {"chat_template": self.eval.data.chat_template, "system_prompt": self.eval.data.system_prompt}
            options.update({key: value for key, value in own.items() if value is not None})
        return options

    def tracking_uri(self) -> str:
        return self.tracking.uri or f"sqlite:///{Path(self.output_dir).resolve() / 'mlflow.db'}"
