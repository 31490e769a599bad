"""The algorithm: the advantage estimator, the policy loss and its aggregation, clipping, the off-policy
correction (TIS / MIS), KL to a reference, entropy, and DAPO's overlong shaping and dynamic sampling.

Names (advantage, policy_loss, loss_aggregation, kl_estimator) are checked against the registries
(operators/algorithms/registry.py) through pipelines/config/world.py's WorldChecks, in the same pass as every
other field. Losses and estimators defined with their own aggregation and clip get them here when the config
leaves them unset (`chosen()` says which)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, PrivateAttr, ValidationInfo, field_validator, model_validator

from pipelines.config.base import Section, raise_at, world_checks


class AlgorithmConfig(Section):
    advantage: str = Field(
        "grpo", description="Advantage estimator: grpo, grpo_no_std, dr_grpo, rloo, reinforce_pp_baseline "
        "(REINFORCE++: group baseline, then whitened over the whole train step), or gae (PPO with a critic: "
        "per-token advantages from the critic's values; needs the critic section)."
    )
    gamma: float = Field(1.0, description="gae: discount per response token, in [0, 1].")
    gae_lambda: float = Field(
        1.0, description="gae: lambda in [0, 1]; 1 is the return minus the value baseline, 0 the one-step TD error."
    )
    gae_whiten: bool = Field(
        True, description="gae: whiten the advantages over the whole train step (every trained token of every group, "
        "every rank: a multi-turn episode's observation tokens do not count) before training on them; the return "
        "targets are not whitened."
    )
    policy_loss: str = Field(
        "ppo_clip", description="Policy loss: ppo_clip (trust region centred on the behaviour policy, 'naive' "
        "under staleness), decoupled_ppo (centred on the proximal policy, importance weight pi_prox / pi_behave, "
        "dual-clip; AReaL), gspo (sequence-level ratio; wants clip_eps_low/high ~3e-4/4e-4)."
    )
    loss_aggregation: str = Field(
        "token_mean",
        description="How per-token losses become one number: token_mean, seq_mean_token_mean, "
        "seq_mean_token_sum_norm (Dr. GRPO).",
    )
    clip_eps_low: float = Field(0.2, ge=0, lt=1, description="PPO clip range below 1.")
    clip_eps_high: float = Field(0.2, ge=0, description="PPO clip range above 1 (DAPO clip-higher when larger).")
    clip_ratio_c: float = Field(
        3.0, description="decoupled_ppo's dual-clip: the loss of a negative-advantage token stops growing once "
        "pi_theta / pi_prox exceeds this (> 1; verl/DAPO use 3)."
    )
    tis: Literal["none", "token", "sequence"] = Field(
        "none", description="Truncated importance sampling on rho = pi_prox / pi_behave (any policy loss): the "
        "behaviour weight becomes min(rho, tis_cap), per token or per response (rho of the whole response)."
    )
    tis_cap: float = Field(2.0, description="TIS cap (> 0; 2 is common).")
    mis: Literal["none", "token", "sequence", "geometric"] = Field(
        "none", description="Masked importance sampling: drop tokens (token) or whole responses (sequence: on "
        "prod rho; geometric: on the geometric mean of rho) whose ratio lies outside [mis_low, mis_high]."
    )
    mis_low: float = Field(0.5, description="MIS lower bound on the ratio (0 < mis_low <= 1).")
    mis_high: float = Field(2.0, description="MIS upper bound on the ratio (>= 1).")
    kl_coef: float = Field(
        0.0, description="Weight of the KL-to-reference term in the loss (>= 0); > 0 needs reference log-probs "
        "per response token (the reference-model stage)."
    )
    kl_estimator: str = Field("k3", description="KL estimator of that term: k1, k2 or k3 (low-variance).")
    kl_reward_coef: float = Field(
        0.0, description="KL to the reference in the reward instead (or as well): kl_reward_coef x the response's "
        "summed k1 (log pi_behave - log pi_ref) is subtracted from its reward before the advantage (>= 0; > 0 "
        "needs the reference stage)."
    )
    entropy_coef: float = Field(0.0, description="Weight of the entropy bonus subtracted from the loss (>= 0).")
    overlong_buffer: int = Field(
        0, description="DAPO soft overlong punishment: responses longer than the budget - this get a penalty "
        "growing linearly to -overlong_penalty at the budget (its floor), added to the reward before the "
        "advantage (0: off). The budget is rollout.max_new_tokens; in multi-turn episodes the policy's tokens "
        "(observations not counted) against min(max_turns x max_new_tokens, max_episode_tokens)."
    )
    overlong_penalty: float = Field(1.0, description="The overlong punishment at max_new_tokens (>= 0).")
    dynamic_sampling: bool = Field(
        False, description="DAPO dynamic sampling: generate dynamic_sampling_groups groups per step, drop those "
        "whose rewards all agree (zero variance: no learning signal) and train train.groups_per_step of the "
        "others, in schedule order; the ledger records every group with what became of it. A step with too few "
        "informative groups is topped up with dropped ones (counted in dynamic_sampling_topped_up)."
    )
    dynamic_sampling_groups: int = Field(
        0, ge=0, description="Groups generated per step with dynamic_sampling (>= train.groups_per_step, a multiple "
        "of rollout.groups_per_call); 0: twice train.groups_per_step."
    )
    whiten_over: Literal["token", "response"] = Field(
        "token", description="reinforce_pp_baseline: whiten the step's advantages over its trained tokens (a "
        "response's advantage counts once per token it trains; verl and OpenRLHF) or over its responses (each "
        "counts once, whatever its length)."
    )
    # What validation chose for fields the config left unset, because the algorithm needs it (one line each).
    _chosen: list = PrivateAttr(default_factory=list)

    @model_validator(mode="after")
    def _pairings(self, info: ValidationInfo) -> "AlgorithmConfig":
        """Losses and estimators that are defined with their own aggregation and clip: a field left unset gets
        the algorithm's (said in `chosen()`), one set against it is refused with the fix."""
        problems = []
        pairs = []  # (field, the algorithm's value, whose, why)
        if self.policy_loss == "gspo":
            pairs += [("loss_aggregation", "seq_mean_token_mean", "policy_loss gspo", "its loss is per response (the "
                       "paper's 1/G sum_i); token_mean would weigh each response by its length"),
                      ("clip_eps_low", 3e-4, "policy_loss gspo", "it clips a sequence ratio that stays within ~1e-3 of 1"),
                      ("clip_eps_high", 4e-4, "policy_loss gspo", "it clips a sequence ratio that stays within ~1e-3 of 1")]
            if self.tis != "none":
                problems.append(f"algorithm.tis: {self.tis} replaces the per-token ratio rho_t that a token-level loss "
                                "carries; gspo's sequence ratio carries the geometric mean of rho instead. Use mis: "
                                "geometric (or sequence) with gspo, or tis with ppo_clip / decoupled_ppo")
        if self.advantage == "dr_grpo":
            pairs.append(("loss_aggregation", "seq_mean_token_sum_norm", "advantage dr_grpo", "Dr. GRPO removes the "
                          "length bias with its aggregation too (a sum over tokens over a constant budget)"))
        for name, value, whose, why in pairs:
            if name not in self.model_fields_set:
                setattr(self, name, value)  # now set: a second pairing that wants another value is refused below
                self._chosen.append(f"algorithm.{name}: {value} (chosen for {whose}: {why})")
            elif name == "loss_aggregation" and getattr(self, name) != value:
                problems.append(f"algorithm.loss_aggregation: {getattr(self, name)} does not fit {whose}: {why}; set "
                                f"loss_aggregation: {value}, or leave it unset")
            elif name.startswith("clip_eps") and getattr(self, name) >= 0.01:
                problems.append(f"algorithm.{name}: {getattr(self, name)} never clips under {whose}: {why}; use "
                                f"{value} (the paper's), or leave it unset")
        if self.dynamic_sampling and world_checks(info).token_estimator(self.advantage):
            problems.append(f"algorithm.dynamic_sampling: it drops groups whose rewards agree, which carry no signal only for "
                            f"group-relative estimators; {self.advantage}'s advantages come from the critic and are not "
                            "zero there. Turn dynamic_sampling off, or use a group estimator (grpo, rloo, ...)")
        raise_at(problems)
        return self

    def chosen(self) -> list[str]:
        """The fields validation set for the algorithm (unset in the config), one line each."""
        return list(self._chosen)

    @field_validator("clip_ratio_c")
    @classmethod
    def _dual_clip_above_one(cls, value: float) -> float:
        if value <= 1:
            raise ValueError(f"{value} must be > 1 (the dual clip bounds ratios above the clip range); use e.g. 3.0")
        return value

    @field_validator("tis_cap")
    @classmethod
    def _positive_cap(cls, value: float) -> float:
        if value <= 0:
            raise ValueError(f"{value} caps the importance weight at nothing; use a cap > 0, e.g. 2.0")
        return value

    @field_validator("kl_coef", "kl_reward_coef", "entropy_coef", "overlong_penalty", "overlong_buffer")
    @classmethod
    def _not_negative(cls, value: float) -> float:
        if value < 0:
            raise ValueError(f"{value} is negative; use 0 (off) or a positive value")
        return value

    @field_validator("gamma", "gae_lambda")
    @classmethod
    def _unit_interval(cls, value: float) -> float:
        if not 0 <= value <= 1:
            raise ValueError(f"{value} is outside [0, 1]; use e.g. 1.0 (gamma) or 0.95 (gae_lambda)")
        return value

    @field_validator("kl_estimator")
    @classmethod
    def _known_kl(cls, name: str, info: ValidationInfo) -> str:
        return world_checks(info).algorithm_name("kl_estimator", name)

    @field_validator("mis_low")
    @classmethod
    def _mis_low_in_unit_interval(cls, value: float) -> float:
        if not 0 < value <= 1:
            raise ValueError(f"{value} must be in (0, 1] (ratios below it are masked); use e.g. 0.5")
        return value

    @field_validator("mis_high")
    @classmethod
    def _mis_high_at_least_one(cls, value: float) -> float:
        if value < 1:
            raise ValueError(f"{value} must be >= 1 (ratios above it are masked); use e.g. 2.0")
        return value

    @field_validator("advantage")
    @classmethod
    def _known_advantage(cls, name: str, info: ValidationInfo) -> str:
        return world_checks(info).algorithm_name("advantage", name)

    @field_validator("policy_loss")
    @classmethod
    def _known_loss(cls, name: str, info: ValidationInfo) -> str:
        return world_checks(info).algorithm_name("policy_loss", name)

    @field_validator("loss_aggregation")
    @classmethod
    def _known_aggregation(cls, name: str, info: ValidationInfo) -> str:
        return world_checks(info).algorithm_name("loss_aggregation", name)
