"""The trainer (`train`): the step and its staleness bound, the optimizer and its schedule, the DeepSpeed
ranks and where they are placed, micro-batches and packing, checkpoints, restarts, preemption and NaN steps.
What a rank reads of it (and of `algorithm`, `rollout` and `model`) is operators/workers/settings.py's
TrainerSettings, filled by name in pipelines/runtime/trainer_settings.py."""

from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import Field, field_validator, model_validator

from pipelines.config.base import CustomResources, GpuCount, Section


class LoraSection(Section):
    """`train.lora`: train low-rank adapters instead of every weight (operators/workers/lora.py)."""

    r: int = Field(16, ge=1, le=1024, description="The adapters' rank.")
    alpha: float = Field(32.0, gt=0, description="The adapters' scale: the update is alpha / r x B A.")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapters' input while training.")
    target_modules: Union[str, list[str]] = Field(
        "all-linear", description="The linear layers that get an adapter: names matched against the end of each "
        "layer's name (e.g. [q_proj, v_proj]), or all-linear (every linear layer but the output head)."
    )

    @field_validator("target_modules")
    @classmethod
    def _named(cls, value):
        if isinstance(value, str) and value != "all-linear":
            raise ValueError(f"{value!r} is neither all-linear nor a list; give a list of layer names (e.g. "
                             f"[{value}]) or all-linear")
        if isinstance(value, list) and (not value or not all(name.strip() for name in value)):
            raise ValueError("give at least one layer name (e.g. [q_proj, v_proj]), or all-linear")
        return value


class TrainConfig(Section):
    steps: int = Field(60, ge=1, description="Optimizer steps (policy updates) in the job.")
    groups_per_step: int = Field(8, ge=1, description="Prompt groups per optimizer step.")
    max_staleness: int = Field(
        1, ge=0, description="How many policy versions generation may run ahead of training; "
        "0 is exact synchronous on-policy RL."
    )
    lr: float = Field(2e-3, gt=0, description="AdamW learning rate (the peak, after warm-up).")
    lr_warmup_steps: int = Field(
        0, ge=0, description="Train steps over which the learning rate rises linearly from lr/warmup to lr "
        "(0: no warm-up)."
    )
    lr_schedule: Literal["constant", "cosine"] = Field(
        "constant", description="After warm-up: keep lr, or decay it along a cosine to lr x lr_min_ratio at the "
        "last step (train.steps)."
    )
    lr_min_ratio: float = Field(0.0, ge=0, le=1, description="cosine only: the final learning rate over lr.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas.")
    grad_clip: float = Field(1.0, gt=0, description="Gradient norm clipping threshold.")
    world_size: int = Field(1, ge=1, description="DeepSpeed ranks (Ray actors) in the trainer group.")
    zero_stage: int = Field(0, ge=0, le=3, description="DeepSpeed ZeRO stage 0-3.")
    dtype: Literal["fp32", "bf16"] = Field("fp32", description="Training precision.")
    num_cpus: float = Field(0.5, gt=0, description="CPUs reserved per trainer rank.")
    num_gpus: GpuCount = Field(0, description="GPUs reserved per trainer rank (1 on GPU clusters).")
    resources: CustomResources = Field(
        default_factory=dict, description="Custom Ray resources per trainer rank, e.g. {train_node: 1}."
    )
    placement: Literal["NONE", "PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "NONE", description="How the trainer ranks are placed. NONE: one by one, meeting on 127.0.0.1 (one machine "
        "only). Otherwise a placement group reserves every rank at once (no half-started group) with this strategy: "
        "PACK (few nodes, best effort), STRICT_PACK (all ranks on one node, e.g. one NVLink island), SPREAD (many "
        "nodes, best effort), STRICT_SPREAD (one rank per node); ranks then meet at rank 0's node IP."
    )
    placement_timeout_s: float = Field(
        300, gt=0, description="Seconds to wait for the cluster to have room for every trainer rank before the "
        "job fails (an autoscaler may need minutes to add nodes)."
    )
    torch_threads: int = Field(1, ge=1, description="torch intra-op threads per trainer rank.")
    zero3_persistence_threshold: Optional[int] = Field(
        None, ge=0, description="ZeRO-3 only: parameters with fewer elements than this stay whole on every rank "
        "instead of being partitioned (DeepSpeed's stage3_param_persistence_threshold; unset: its default, 1e5). "
        "Lower saves memory, higher saves all-gathers."
    )
    micro_batch_tokens: int = Field(
        0, ge=0,
        description="Split each rank's samples into micro-batches of at most this many tokens (0: one batch): "
        "packed, their tokens in all (train.packing); padded, sorted by length and each padded to its longest. "
        "Each micro-batch runs its own forward and backward (gradients accumulate to one optimizer step), so "
        "memory follows the micro-batch while the step is unchanged.",
    )
    packing: bool = Field(
        True, description="Pack each micro-batch's sequences into one row with position ids that restart at each "
        "sequence (a block-diagonal causal mask, no padding) for the policy, the critic and the reference model; "
        "the same loss and gradients as padded rows, without computing on padding. false: right-padded rows.",
    )
    share_prompts: bool = Field(
        False, description="Lay each group's prompt out once, before its responses, in the policy's packed "
        "micro-batches, the reference model's and the critic's: a 4D attention mask keeps each response to the prompt and itself, so the loss and "
        "gradients are those of one sequence per response, and the prompt's tokens are computed once per group "
        "instead of once per response (operators/algorithms/shared_prompts.py). Needs train.packing and SDPA or "
        "eager attention; a row grows to at most 4x the longest sequence (more attention, fewer tokens)."
    )
    logits_chunk_tokens: int = Field(
        2048, ge=0, description="Compute the log-probs and entropy of at most this many token positions "
        "(rows x positions) at once, recomputing them in backward, so a micro-batch never holds its whole "
        "[B, L, vocab] fp32 logits (for a 150k vocabulary 2048 positions are 1.2 GB of logits, ~5 GB with "
        "their softmax and gradient). 0: all at once."
    )
    gradient_checkpointing: bool = Field(
        False, description="Recompute each transformer layer's activations in backward instead of keeping them "
        "(Hugging Face gradient checkpointing): less memory, ~30% more compute."
    )
    weight_bucket_mb: float = Field(
        256, gt=0, description="Weights are published to the generators in the training dtype (bf16: 2 bytes a "
        "weight), in buckets of at most this many MB, gathered one module at a time under ZeRO-3; each bucket is "
        "one broadcast on the weight plane, or one object in Ray's object store (rollout.weight_transfer; "
        "operators/weights/buckets.py)."
    )
    ppo_epochs: int = Field(
        1, ge=1, description="Passes over each train step's samples. A policy version still counts train steps "
        "(batches), so the staleness bound, checkpoints and the ledger do not depend on it."
    )
    mini_batches: int = Field(
        1, ge=1, description="Optimizer steps per pass: each rank's samples of the step split into this many "
        "equal mini-batches (must divide groups_per_step x rollout.n / world_size)."
    )
    seed: int = Field(0, description="Seed of the trainer and the samplers.")
    lora: Optional[LoraSection] = Field(
        None, description="Train LoRA adapters on the policy instead of every weight ({} for the defaults: rank "
        "16, alpha 32, every linear layer): the optimizer holds state for the adapters only and checkpoints hold "
        "them alone. The generators get the merged weights (W + alpha/r B A) at each update, as with full "
        "fine-tuning. Needs peft (pip install 'streamrl[lora]'). Adapters usually want a higher lr than full "
        "fine-tuning. null: train every weight."
    )
    checkpoint_every: int = Field(
        10, ge=0, description="Write a resumable checkpoint (DeepSpeed model + optimizer state, RNG states, the "
        "ledger of trained groups) every this many steps; 0: only after the last step, which always gets one. "
        "Step metrics reach MLflow when a checkpoint covers them (so a restarted step is logged once): MLflow "
        "lags the console by up to this many steps."
    )
    checkpoint_keep: int = Field(
        2, ge=0, description="Keep the newest this many checkpoints of a run on disk (0: all); older ones are "
        "deleted once a newer one is complete and, with tracking on, once MLflow has them (an outage keeps "
        "them until their upload is delivered). Short of disk for the next one, the oldest goes first."
    )
    checkpoint_hf_export: Literal["every", "last"] = Field(
        "every", description="Which checkpoints also hold the policy as a Hugging Face folder (config, weights, "
        "tokenizer) that from_pretrained, vLLM and `streamrl eval` load: every one, or only the last (saves the "
        "disk of one copy of the weights per checkpoint on large models)."
    )
    disk_full_wait_s: float = Field(
        300.0, ge=0, description="When a checkpoint or rollouts file finds the disk full, wait up to this "
        "long for room (the newest checkpoint's size, said at the time), then restart from the last checkpoint "
        "(counts as a restart); no room by then: the job fails with the command that resumes it."
    )
    max_restarts: int = Field(
        1, ge=0, description="When an actor the job cannot do without dies (a trainer rank, the Train "
        "operator), restart the trainer group and the DAG from the last checkpoint up to this many times, "
        "then fail with the command that resumes the run. Generate and reward actors are restarted by "
        "Ray Data without a rollback."
    )
    node_wait_s: float = Field(
        300, ge=0, description="When a restart follows the loss of a node and the job no longer fits the nodes "
        "left (e.g. train.placement STRICT_SPREAD with a rank per node), wait up to this many seconds for nodes to "
        "join (the node returning, an autoscaler replacing it), then fail with the command that resumes the run; "
        "0: fail at once. A job that fits the nodes left restarts on them without waiting (pipelines/runtime/nodes.py)."
    )
    on_preempt: Literal["finish_step", "abandon_step"] = Field(
        "finish_step", description="On SIGTERM to the driver (spot preemption, `ray job stop`, a Kubernetes pod's "
        "termination): 'finish_step' trains the step in progress to its end, checkpoints it and stops; "
        "'abandon_step' stops at once, and a resume starts from the last checkpoint. Either way the run's MLflow "
        "records are flushed, the resume command is printed and `streamrl run` exits 75. A second SIGTERM stops "
        "at once (exit 130). See pipelines/recovery/preemption.py."
    )
    preempt_grace_s: float = Field(
        25.0, gt=0, description="Seconds a graceful stop may take from the first SIGTERM (Kubernetes kills after "
        "terminationGracePeriodSeconds, 30 by default): past ~80% of it, a step that has not ended is abandoned."
    )
    nan_policy: Literal["skip", "stop"] = Field(
        "skip", description="A step whose loss is NaN or inf: 'skip' leaves the weights unchanged (counted in "
        "the nonfinite_skipped metric; with several optimizer steps per train step, the ones before the "
        "non-finite one stay applied and the rest are dropped), 'stop' fails the job. Non-finite weights are "
        "never published."
    )
    max_nan_skips: int = Field(
        10, ge=0, description="With nan_policy: skip, fail the job after this many skipped steps in a run."
    )
    stall_report_s: float = Field(
        300.0, ge=0, description="When no step has ended for this many seconds, print what the job is waiting "
        "on (free resources, actors and their states, the policy version, thread stacks; "
        "pipelines/runtime/stall.py), again after twice as long, and so on. It only reports; 0 turns it off. "
        "Raise it for models whose steps take longer."
    )

    @model_validator(mode="after")
    def _shared_prompts_need_packing(self) -> "TrainConfig":
        if self.share_prompts and not self.packing:
            raise ValueError("train.share_prompts lays prompts out in packed rows and needs train.packing: true; "
                             "set train.packing: true or train.share_prompts: false")
        return self
