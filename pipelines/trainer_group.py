"""Start the DeepSpeed worker group: `world_size` Ray actors, one rank each."""

from __future__ import annotations

import socket

import ray

from operators.train_worker import TrainerSettings, TrainWorker
from pipelines.config import JobConfig


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def trainer_settings(cfg: JobConfig, model_path: str) -> TrainerSettings:
    return TrainerSettings(
        model_path=model_path,
        lr=cfg.train.lr,
        betas=tuple(cfg.train.betas),
        weight_decay=cfg.train.weight_decay,
        grad_clip=cfg.train.grad_clip,
        zero_stage=cfg.train.zero_stage,
        dtype=cfg.train.dtype,
        seed=cfg.train.seed,
        torch_threads=cfg.train.torch_threads,
        temperature=cfg.rollout.temperature,
        policy_loss=cfg.algorithm.policy_loss,
        loss_aggregation=cfg.algorithm.loss_aggregation,
        clip_eps_low=cfg.algorithm.clip_eps_low,
        clip_eps_high=cfg.algorithm.clip_eps_high,
        max_new_tokens=cfg.rollout.max_new_tokens,
        trust_remote_code=cfg.model.trust_remote_code,
    )


def start_trainer_group(cfg: JobConfig, model_path: str, policy_store: str) -> tuple[list, list[dict]]:
    """Create the ranks, wait until every one has initialised DeepSpeed; return handles and placement."""
    settings = trainer_settings(cfg, model_path)
    port = _free_port()
    actor = ray.remote(TrainWorker).options(num_cpus=cfg.train.num_cpus, max_concurrency=1)
    workers = [
        actor.remote(rank, cfg.train.world_size, port, settings, policy_store) for rank in range(cfg.train.world_size)
    ]
    placement = ray.get([worker.ready.remote() for worker in workers])
    return workers, placement
