"""A simulated trainer rank: `TrainWorker`'s interface and weight channel, a cost model's compute.

Used by `benchmarks/simulate_cluster.py` in place of the DeepSpeed ranks: the `Train`
operator calls `train_step(samples, global_tokens, global_sequences)` on every rank as it
does on real ones; each rank sleeps for the step's modelled cost (data-parallel ranks run
in parallel, so every rank sleeps the whole step), and rank 0 then publishes version + 1
to the policy store exactly as the trainer's `Publisher` does (a tiny weights dict through
the object store), which is what opens the admission gate for later steps.

Cost of one step in simulated seconds, divided by `time_scale` to sleep:

    train_seconds_per_token * (response tokens + prompt tokens) / train_gpus + train_step_fixed_s

Response tokens are the fake ids the sim engine returned times `token_unit`.
"""

from __future__ import annotations

import os
import time

import numpy as np

from benchmarks.sim_cost import CostModel


class SimTrainWorker:
    def __init__(self, rank: int, world_size: int, cost_model_path: str, policy_store):
        import ray

        self.rank, self.world_size = rank, world_size
        self.cost = CostModel.load(cost_model_path)
        self.store = policy_store if rank == 0 else None  # a PolicyStoreClient (operators/weights/store.py)
        self.version = 0

    def ready(self) -> dict:
        import ray

        return {"rank": self.rank, "node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid()}

    def step_seconds(self, global_tokens: int, global_sequences: int) -> float:
        """Simulated seconds of one optimizer step over the whole batch."""
        cost = self.cost
        tokens = global_tokens * cost.token_unit + global_sequences * cost.prompt_tokens
        return cost.train_seconds_per_token * tokens / cost.train_gpus + cost.train_step_fixed_s

    def train_step(self, samples: dict, global_tokens: int, global_sequences: int) -> dict:
        start = time.perf_counter()
        time.sleep(self.step_seconds(global_tokens, global_sequences) / self.cost.time_scale)
        self.version += 1
        publish_seconds = self._publish() if self.rank == 0 else 0.0
        num_tokens = int(sum(len(tokens) for tokens in samples["response_token_ids"]))
        return {
            "policy_loss": 0.0, "entropy": 0.0, "grad_norm": 0.0, "num_tokens": num_tokens,
            "clip_fraction": 0.0, "approx_kl": 0.0, "ratio_mean": 1.0, "ratio_max": 1.0,
            "grad_norm_last": 0.0, "optimizer_steps": 1, "mismatch": [],  # the fields a real rank reports
            "train_seconds": time.perf_counter() - start - publish_seconds,
            "publish_seconds": publish_seconds,
        }

    def _publish(self) -> float:
        import ray

        start = time.perf_counter()
        weights_ref = ray.put({"version": np.array(self.version)})
        self.store.publish(self.version, weights_ref)
        return time.perf_counter() - start


def start_sim_trainers(cost_model_path: str, policy_store, world_size: int = 1, resources: dict | None = None):
    """`world_size` simulated ranks as Ray actors; `resources` per rank (e.g. {"sim_gpu": 4})."""
    import ray

    actor = ray.remote(SimTrainWorker).options(num_cpus=0.05, max_concurrency=1, resources=resources or {})
    workers = [actor.remote(rank, world_size, cost_model_path, policy_store) for rank in range(world_size)]
    ray.get([worker.ready.remote() for worker in workers])
    return workers
