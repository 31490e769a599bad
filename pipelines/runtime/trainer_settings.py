"""What the config asks of the trainer and critic ranks: the config mapped onto `TrainerSettings`
(operators/workers/settings.py) and onto the Advantage and Train operators' options. No Ray here: the
job (pipelines/runtime/trainer_group.py, pipelines/stages.py) and the one-process loop
(pipelines/plain_loop.py) use the same mapping."""

from __future__ import annotations

from operators.algorithms.correction import CorrectionSettings
from operators.algorithms.estimators import STEP_WHITENED
from operators.workers.settings import LrSchedule, TrainerSettings
from pipelines.config.schema import JobConfig, ModelConfig


def updates_per_step(cfg: JobConfig) -> int:
    """Optimizer steps per train step (the LR schedule advances per optimizer step)."""
    return cfg.train.ppo_epochs * cfg.train.mini_batches


# Where each TrainerSettings field comes from in the config: the one map from config to trainer (a
# field not named here keeps TrainerSettings' default, which tests/unit/test_config.py (test_one_map_from_config_to_trainer_settings_and_the_same_defaults) checks
# equals the config's). The critic's ranks read the same map with CRITIC_SETTINGS on top.
POLICY_SETTINGS = {
    "lr": "train.lr", "betas": "train.betas", "weight_decay": "train.weight_decay", "grad_clip": "train.grad_clip",
    "zero_stage": "train.zero_stage", "dtype": "train.dtype", "seed": "train.seed",
    "torch_threads": "train.torch_threads", "micro_batch_tokens": "train.micro_batch_tokens",
    "packing": "train.packing", "share_prompts": "train.share_prompts",
    "logits_chunk_tokens": "train.logits_chunk_tokens", "gradient_checkpointing": "train.gradient_checkpointing",
    "weight_bucket_mb": "train.weight_bucket_mb", "nan_policy": "train.nan_policy",
    "weight_timeout_s": "rollout.weight_timeout_s", "verify_weights_every": "rollout.verify_weights_every",
    "zero3_persistence_threshold": "train.zero3_persistence_threshold", "ppo_epochs": "train.ppo_epochs",
    "mini_batches": "train.mini_batches", "temperature": "rollout.temperature",
    "trust_remote_code": "model.trust_remote_code",
    "policy_loss": "algorithm.policy_loss", "loss_aggregation": "algorithm.loss_aggregation",
    "clip_eps_low": "algorithm.clip_eps_low", "clip_eps_high": "algorithm.clip_eps_high",
    "clip_ratio_c": "algorithm.clip_ratio_c", "kl_coef": "algorithm.kl_coef",
    "kl_estimator": "algorithm.kl_estimator", "entropy_coef": "algorithm.entropy_coef",
}
# The critic: its own section's optimiser and ranks; the policy's step shape (micro-batches, epochs,
# mini-batches), seed and NaN policy; none of the policy loss's settings (the critic's loss is its own).
CRITIC_SETTINGS = {
    **{name: POLICY_SETTINGS[name] for name in (
        "seed", "micro_batch_tokens", "packing", "share_prompts", "gradient_checkpointing", "weight_bucket_mb", "nan_policy",
        "zero3_persistence_threshold", "ppo_epochs", "mini_batches", "trust_remote_code")},
    "lr": "critic.lr", "grad_clip": "critic.grad_clip", "zero_stage": "critic.zero_stage",
    "torch_threads": "critic.torch_threads",
}


def config_value(cfg: JobConfig, dotted: str):
    value = cfg
    for part in dotted.split("."):
        value = getattr(value, part)
    return tuple(value) if isinstance(value, list) else value


def settings_from(cfg: JobConfig, model_path: str, table: dict[str, str], **extra) -> TrainerSettings:
    return TrainerSettings(model_path=model_path, **{name: config_value(cfg, path) for name, path in table.items()},
                           **extra)


def trainer_settings(cfg: JobConfig, model_path: str) -> TrainerSettings:
    """The policy ranks' settings (POLICY_SETTINGS, plus the LR schedule and the off-policy correction,
    which are built from several fields)."""
    return settings_from(
        cfg, model_path, POLICY_SETTINGS, max_new_tokens=cfg.policy_budget(), weight_transfer=cfg.weight_plane(),
        lr_schedule=LrSchedule(
            warmup_steps=cfg.train.lr_warmup_steps * updates_per_step(cfg),
            total_steps=cfg.train.steps * updates_per_step(cfg),
            kind=cfg.train.lr_schedule, min_ratio=cfg.train.lr_min_ratio,
        ),
        correction=CorrectionSettings(
            tis=cfg.algorithm.tis, tis_cap=cfg.algorithm.tis_cap,
            mis=cfg.algorithm.mis, mis_low=cfg.algorithm.mis_low, mis_high=cfg.algorithm.mis_high,
        ),
    )


def critic_settings(cfg: JobConfig, model_path: str) -> TrainerSettings:
    """The critic's DeepSpeed settings: its own section's, and the policy's update schedule."""
    return settings_from(cfg, model_path, CRITIC_SETTINGS)


def critic_model_path(cfg: JobConfig, policy_path: str) -> str:
    """The critic's local folder (`policy_path`, already resolved, when it is the policy's model)."""
    if cfg.critic.model_path == cfg.model.path:
        return policy_path
    from pipelines.data.models import resolve_model_path

    return resolve_model_path(ModelConfig(path=cfg.critic.model_path, trust_remote_code=cfg.model.trust_remote_code),
                              "critic.model_path")


def advantage_options(cfg: JobConfig) -> dict:
    """Constructor arguments of the Advantage operator (operators.advantage)."""
    options = {"estimator": cfg.algorithm.advantage, "max_new_tokens": cfg.policy_budget(),
               "overlong_buffer": cfg.algorithm.overlong_buffer, "overlong_penalty": cfg.algorithm.overlong_penalty,
               "kl_reward_coef": cfg.algorithm.kl_reward_coef}
    if cfg.critic is not None:  # a token estimator (config validation)
        options.update(gamma=cfg.algorithm.gamma, gae_lambda=cfg.algorithm.gae_lambda)
    return options


def train_options(cfg: JobConfig) -> dict:
    """The algorithm's constructor arguments of the Train operator (operators.train)."""
    if cfg.algorithm.advantage in STEP_WHITENED:
        whiten = cfg.algorithm.whiten_over
    else:  # GAE's advantages are per token: over the trained tokens
        whiten = "token" if cfg.critic is not None and cfg.algorithm.gae_whiten else None
    return {"whiten_advantages": whiten,
            "mini_batches": cfg.train.mini_batches}
