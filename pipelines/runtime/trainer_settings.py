"""What the config asks of the trainer and critic ranks: the config onto `TrainerSettings`
(operators/workers/settings.py, the one declaration of what a rank reads) and onto the Advantage and Train
operators' options. No Ray here: the job (pipelines/runtime/trainer_group.py, pipelines/stages.py) and the
one-process loop (pipelines/plain_loop.py) use the same mapping.

A TrainerSettings field takes the config field of its own name, from the first section that has one
(POLICY_SECTIONS, CRITIC_SECTIONS): a field is named once, in TrainerSettings and its config section, and no
table lists them again. The few built from several fields (the LR schedule, the off-policy correction, the
policy's token budget, the resolved weight transfer) are built here."""

from __future__ import annotations

import dataclasses

from operators.algorithms.correction import CorrectionSettings
from operators.algorithms.estimators import STEP_WHITENED, policy_token_budget
from operators.weights.probe import probe_tolerance
from operators.workers.lora import LoraSettings
from operators.workers.settings import LrSchedule, TrainerSettings
from pipelines.config.job import JobConfig
from pipelines.config.model import ModelConfig
from pipelines.runtime.rollout_settings import weight_plane

# Where the policy ranks' fields come from, first match wins: train before rollout (torch_threads is the trainer's).
POLICY_SECTIONS = ("train", "algorithm", "rollout", "model")
# The critic: its own section's optimiser and ranks (lr, grad_clip, zero_stage, torch_threads); the policy's
# step shape (micro-batches, epochs, mini-batches), seed, NaN policy and memory layout; none of the policy
# loss's settings (the critic's loss is its own), nothing of the rollout's.
CRITIC_SECTIONS = ("critic", "train", "model")
# train's fields the critic does not take (it keeps TrainerSettings' defaults): it trains in fp32 at a constant
# lr with AdamW's default betas and no weight decay, and has no vocabulary to chunk.
NOT_FOR_THE_CRITIC = frozenset({"betas", "weight_decay", "dtype", "lr_schedule", "logits_chunk_tokens", "lora"})


def updates_per_step(cfg: JobConfig) -> int:
    """Optimizer steps per train step (the LR schedule advances per optimizer step)."""
    return cfg.train.ppo_epochs * cfg.train.mini_batches


def policy_budget(cfg: JobConfig) -> int:
    """The most tokens the policy writes per response (a multi-turn episode's turns together): the length
    budget of the overlong shaping and Dr. GRPO's normaliser (operators.algorithms.estimators.policy_token_budget)."""
    env = cfg.rollout.environment
    return policy_token_budget(cfg.rollout.max_new_tokens,
                               *(() if env is None else (env.max_turns, env.max_episode_tokens)))


def config_sources(cfg: JobConfig, sections: tuple[str, ...], built: tuple[str, ...] = ()) -> dict[str, str]:
    """For each TrainerSettings field not in `built`, the config field it takes ('section.field'): the first of
    `sections` with a field of its name. A field that no section has keeps TrainerSettings' default (for the
    critic, the policy loss's fields)."""
    sources = {}
    for field in dataclasses.fields(TrainerSettings):
        found = [section for section in sections if field.name in type(getattr(cfg, section)).model_fields]
        if field.name != "model_path" and field.name not in built and found:
            sources[field.name] = f"{found[0]}.{field.name}"
    return sources


def settings_from(cfg: JobConfig, model_path: str, sources: dict[str, str], **built) -> TrainerSettings:
    def value(dotted: str):
        section, name = dotted.split(".")
        found = getattr(getattr(cfg, section), name)
        return tuple(found) if isinstance(found, list) else found

    return TrainerSettings(model_path=model_path, **{name: value(path) for name, path in sources.items()}, **built)


def trainer_settings(cfg: JobConfig, model_path: str) -> TrainerSettings:
    """The policy ranks' settings: every field from POLICY_SECTIONS by name, plus the LR schedule, the
    off-policy correction, the token budget and the weight transfer, which are built from several fields."""
    built = dict(
        max_new_tokens=policy_budget(cfg), weight_transfer=weight_plane(cfg),
        lr_schedule=LrSchedule(
            warmup_steps=cfg.train.lr_warmup_steps * updates_per_step(cfg),
            total_steps=cfg.train.steps * updates_per_step(cfg),
            kind=cfg.train.lr_schedule, min_ratio=cfg.train.lr_min_ratio,
        ),
        lora=lora_settings(cfg), reference_on_trainer=cfg.reference_on_trainer(), serve_adapters=cfg.serves_adapters(),
        # the HF engine computes in float32 (operators/engines/hf.py)
        probe_tolerance=probe_tolerance(cfg.rollout.probe_tolerance, cfg.train.dtype,
                                        cfg.rollout.vllm.dtype if cfg.rollout.engine == "vllm" else "float32"),
        correction=CorrectionSettings(
            tis=cfg.algorithm.tis, tis_cap=cfg.algorithm.tis_cap,
            mis=cfg.algorithm.mis, mis_low=cfg.algorithm.mis_low, mis_high=cfg.algorithm.mis_high,
        ),
    )
    return settings_from(cfg, model_path, config_sources(cfg, POLICY_SECTIONS, built=tuple(built)), **built)


def lora_settings(cfg: JobConfig) -> LoraSettings | None:
    """train.lora as the ranks read it; None: every weight trains."""
    lora = cfg.train.lora
    if lora is None:
        return None
    targets = lora.target_modules if isinstance(lora.target_modules, str) else tuple(lora.target_modules)
    return LoraSettings(r=lora.r, alpha=lora.alpha, dropout=lora.dropout, target_modules=targets)


def critic_settings(cfg: JobConfig, model_path: str) -> TrainerSettings:
    """The critic's DeepSpeed settings: its own section's, and the policy's update schedule."""
    return settings_from(cfg, model_path, critic_sources(cfg))


def critic_sources(cfg: JobConfig) -> dict[str, str]:
    sources = config_sources(cfg, CRITIC_SECTIONS)
    return {name: path for name, path in sources.items()
            if not (name in NOT_FOR_THE_CRITIC and path.startswith("train."))}


def critic_model_path(cfg: JobConfig, policy_path: str) -> str:
    """The critic's local folder (`policy_path`, already resolved, when it is the policy's model)."""
    if cfg.critic.model_path == cfg.model.path:
        return policy_path
    from pipelines.data.models import resolve_model_path

    return resolve_model_path(ModelConfig(path=cfg.critic.model_path, trust_remote_code=cfg.model.trust_remote_code),
                              "critic.model_path")


def advantage_options(cfg: JobConfig) -> dict:
    """Constructor arguments of the Advantage operator (operators.stages.advantage)."""
    options = {"estimator": cfg.algorithm.advantage, "max_new_tokens": policy_budget(cfg),
               "overlong_buffer": cfg.algorithm.overlong_buffer, "overlong_penalty": cfg.algorithm.overlong_penalty,
               "kl_reward_coef": cfg.algorithm.kl_reward_coef}
    if cfg.critic is not None:  # a token estimator (config validation)
        options.update(gamma=cfg.algorithm.gamma, gae_lambda=cfg.algorithm.gae_lambda)
    return options


def train_options(cfg: JobConfig) -> dict:
    """The algorithm's constructor arguments of the Train operator (operators.stages.train)."""
    if cfg.algorithm.advantage in STEP_WHITENED:
        whiten = cfg.algorithm.whiten_over
    else:  # GAE's advantages are per token: over the trained tokens
        whiten = "token" if cfg.critic is not None and cfg.algorithm.gae_whiten else None
    return {"whiten_advantages": whiten,
            "mini_batches": cfg.train.mini_batches}
