"""MLflow lineage (`tracking`): where the job is recorded and what is logged."""

from __future__ import annotations

from typing import Optional

from pydantic import Field

from pipelines.config.base import Section


class TrackingConfig(Section):
    enabled: bool = Field(True, description="Record the job in MLflow.")
    uri: Optional[str] = Field(
        None, description="MLflow tracking URI; default sqlite:///<output_dir>/mlflow.db."
    )
    experiment: str = Field("streamrl", description="MLflow experiment name.")
    log_rollouts: bool = Field(True, description="Log each step's rollouts as a Parquet artifact.")
    log_model: bool = Field(
        True, description="When the job finishes, log the final checkpoint's policy (its Hugging Face export: "
        "config, weights, tokenizer) as an MLflow model of the run (transformers flavour, task text-generation; "
        "mlflow.transformers.load_model('models:/<model id>') loads it), with its step, policy version, "
        "checkpoint and dataset digests. Costs a second upload of the weights to the artifact store (the "
        "checkpoint's artifacts hold one) and, while MLflow packages it, a temporary local copy of them: turn "
        "it off for large models on a small or slow artifact store. Delivered like every record (an outage "
        "delays it); a failure never fails the job. With train.lora the model logged is the adapter on its own "
        "(peft's adapter folder and the tokenizer, a few MB; its params name the base model: "
        "PeftModel.from_pretrained(base, folder) loads it); log_merged_model logs the merged policy as well."
    )
    log_merged_model: bool = Field(
        False, description="With train.lora and log_model: also log the policy with the adapters merged into the "
        "base model, as the transformers-flavour model a full fine-tuning run logs (the whole model's bytes)."
    )
    run_name: Optional[str] = Field(None, description="MLflow run name; default is MLflow's.")
    flush_timeout_s: float = Field(
        300, ge=0, description="At the end of a job, how long to wait for records buffered while the tracking "
        "server was unreachable; what is still undelivered then stays in <output_dir>/mlflow_spool and "
        "`streamrl run CONFIG --resume RUN_ID` delivers it."
    )
    request_timeout_s: int = Field(
        10, ge=1, description="Timeout in seconds of one HTTP request to the tracking server "
        "(MLFLOW_HTTP_REQUEST_TIMEOUT, unless that is set): short, so an outage is noticed quickly and "
        "buffered; raise it if large artifacts go through a proxying server to slow storage."
    )
