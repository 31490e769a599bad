"""One DeepSpeed rank of the trainer group, run as a Ray actor (see `pipelines.trainer_group`).

Each optimizer step gets this rank's shard of the step's samples (the same number of
samples on every rank), computes the policy loss on the behaviour log-probs, steps the
DeepSpeed engine (ZeRO stage from config, gradient clipping) and, on rank 0, publishes
the new weights to the policy store.
"""

from __future__ import annotations

import base64
import contextlib
import inspect
import json
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np


def _as_float32(values) -> np.ndarray:
    """float32 with overflow to +-inf (torch refuses such casts with an error); a non-finite value
    then shows up in the loss, which the NaN guard handles instead of the step crashing."""
    with np.errstate(over="ignore"):
        return np.asarray(values, dtype=np.float64).astype(np.float32)


class NonFiniteError(RuntimeError):
    """The loss or the weights became NaN/inf and the job must stop (nothing was published)."""


@dataclass(frozen=True)
class TrainerSettings:
    model_path: str
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    zero_stage: int = 0
    dtype: str = "fp32"
    seed: int = 0
    torch_threads: int = 1
    temperature: float = 1.0
    policy_loss: str = "ppo_clip"
    loss_aggregation: str = "token_mean"
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    max_new_tokens: int = 16
    trust_remote_code: bool = False
    micro_batch_tokens: int = 0
    zero3_persistence_threshold: int | None = None  # DeepSpeed's default (1e5 elements) when None
    nan_policy: str = "skip"  # a non-finite loss: "skip" the step (weights unchanged) or "stop" the job


class TrainWorker:
    def __init__(
        self, rank: int, world_size: int, master_port: int, settings: TrainerSettings, policy_store: str | None
    ):
        """`policy_store`: name of the store actor rank 0 publishes to; None to publish nowhere
        (a plain single-process loop pulls weights with `state_dict()` instead)."""
        os.environ.update({
            "MASTER_ADDR": os.environ.get("STREAMRL_MASTER_ADDR", "127.0.0.1"),
            "MASTER_PORT": str(master_port), "RANK": str(rank), "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": "0", "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu"),
        })
        import deepspeed
        import ray
        import torch
        from transformers import AutoModelForCausalLM

        # No JIT-compiled ops: the shared-memory comm op and fused Adam each cost 20-40 s to build on CPU.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        torch.set_num_threads(settings.torch_threads)
        torch.manual_seed(settings.seed)
        deepspeed.init_distributed(dist_backend="gloo")
        self.torch, self.deepspeed = torch, deepspeed
        self.rank, self.world_size, self.settings = rank, world_size, settings
        model = AutoModelForCausalLM.from_pretrained(
            settings.model_path, local_files_only=True, dtype=torch.float32,
            trust_remote_code=settings.trust_remote_code,
        )
        optimizer = torch.optim.AdamW(
            model.parameters(), lr=settings.lr, betas=settings.betas, weight_decay=settings.weight_decay
        )
        config = {
            "train_batch_size": world_size,
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": settings.grad_clip,
            "zero_optimization": {"stage": settings.zero_stage, **(
                {"stage3_param_persistence_threshold": settings.zero3_persistence_threshold}
                if settings.zero3_persistence_threshold is not None else {})},
            "zero_allow_untested_optimizer": True,
            "bf16": {"enabled": settings.dtype == "bf16"},
            "steps_per_print": 10**9,
        }
        self.engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
        self.pad_id = model.config.pad_token_id or 0
        self.store = ray.get_actor(policy_store) if rank == 0 and policy_store else None
        # Under ZeRO-3 gathering the full weights is a collective: every rank takes part in a
        # publish, rank 0 alone sends them. (Small models hide this: DeepSpeed keeps parameters
        # below stage3_param_persistence_threshold whole on every rank, so nothing is gathered.)
        self.joins_publish = policy_store is not None and (rank == 0 or settings.zero_stage == 3)
        self.version = 0

    def ready(self) -> dict:
        """Where this rank runs (tests check placement)."""
        import ray

        return {"rank": self.rank, "node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid()}

    def _batch_tensors(self, samples: dict):
        """Right-padded [B, L] inputs; response positions in shifted (next-token) coordinates."""
        torch = self.torch
        sequences = [list(p) + list(r) for p, r in zip(samples["prompt_token_ids"], samples["response_token_ids"])]
        width = max(len(seq) for seq in sequences)
        batch = len(sequences)
        input_ids = torch.full((batch, width), self.pad_id, dtype=torch.long)  # [B, L]
        attention = torch.zeros((batch, width), dtype=torch.long)  # [B, L]
        mask = torch.zeros((batch, width - 1))  # [B, L-1]: 1 where a response token is predicted
        old_logprobs = torch.zeros((batch, width - 1))  # [B, L-1]
        advantages = torch.zeros((batch, width - 1))  # [B, L-1]
        for row, seq in enumerate(sequences):
            prompt_len, response_len = len(samples["prompt_token_ids"][row]), len(samples["response_token_ids"][row])
            input_ids[row, : len(seq)] = torch.tensor(seq)
            attention[row, : len(seq)] = 1
            span = slice(prompt_len - 1, prompt_len - 1 + response_len)
            mask[row, span] = 1.0
            old_logprobs[row, span] = torch.from_numpy(_as_float32(samples["behavior_logprobs"][row]))
            advantages[row, span] = float(_as_float32([samples["advantages"][row]])[0])
        return input_ids, attention, mask, old_logprobs, advantages

    def _aggregate(self, per_token_loss, mask, global_tokens: int, global_sequences: int, share: float = 1.0):
        """Aggregate so that the DeepSpeed gradient average over ranks equals the global aggregate.

        Aggregations normalised by a global count (tokens, sequences) are sums over samples,
        so micro-batch losses add up exactly; one that averages over its own batch
        (seq_mean_token_mean) is weighted by the micro-batch's `share` of the rank's sequences."""
        from operators.losses import LOSS_AGGREGATIONS

        aggregate = LOSS_AGGREGATIONS.get(self.settings.loss_aggregation)
        options = {
            "num_tokens": global_tokens / self.world_size,
            "num_sequences": global_sequences / self.world_size,
            "max_tokens": self.settings.max_new_tokens,
        }
        accepted = inspect.signature(aggregate).parameters
        loss = aggregate(per_token_loss, mask, **{k: v for k, v in options.items() if k in accepted})
        linear = any(k in accepted for k in ("num_tokens", "num_sequences"))
        return loss if linear else loss * share

    def micro_batches(self, samples: dict) -> list[list[int]]:
        """Sample indices per micro-batch: sorted by length, cut so that no micro-batch pads to more
        than `micro_batch_tokens` tokens (0: one batch, in arrival order). On long-tailed response
        lengths this removes most padding: short responses no longer pad to the longest one."""
        count = len(samples["advantages"])
        budget = self.settings.micro_batch_tokens
        if not budget:
            return [list(range(count))] if count else []
        lengths = [len(p) + len(r) for p, r in zip(samples["prompt_token_ids"], samples["response_token_ids"])]
        batches, current, width = [], [], 0
        for index in sorted(range(count), key=lambda i: lengths[i]):
            grown = max(width, lengths[index])
            if current and grown * (len(current) + 1) > budget:
                batches.append(current)
                current, grown = [], lengths[index]
            current.append(index)
            width = grown
        return batches + ([current] if current else [])

    def train_step(self, samples: dict, global_tokens: int, global_sequences: int) -> dict:
        """One optimizer step on this rank's shard; rank 0 then publishes version + 1.

        The shard may be split into micro-batches (`micro_batch_tokens`); their losses are
        summed into one backward pass, so the step equals the unsplit one (up to float
        reassociation) under every loss aggregation and ZeRO stage."""
        from operators.losses import POLICY_LOSSES, entropy_from_logits, token_logprobs

        torch, settings = self.torch, self.settings
        start = time.perf_counter()
        self.engine.train()
        batches = self.micro_batches(samples)
        if not batches:
            raise ValueError("train_step got no samples")
        valid_sequences = sum(1 for r in samples["response_token_ids"] if len(r))
        loss, tokens, entropy_sum, merged = 0.0, 0, 0.0, {}
        for indices in batches:
            part = {key: [values[i] for i in indices] for key, values in samples.items()}
            input_ids, attention, mask, old_logprobs, advantages = self._batch_tensors(part)
            logits = self.engine(input_ids=input_ids, attention_mask=attention).logits[:, :-1].float()  # [B, L-1, V]
            logits = logits / settings.temperature
            logprobs = token_logprobs(logits, input_ids[:, 1:])  # [B, L-1]
            per_token_loss, stats = POLICY_LOSSES.get(settings.policy_loss)(
                logprobs, old_logprobs, advantages, mask,
                clip_eps_low=settings.clip_eps_low, clip_eps_high=settings.clip_eps_high,
            )
            part_valid = sum(1 for r in part["response_token_ids"] if len(r))
            loss = loss + self._aggregate(per_token_loss, mask, global_tokens, global_sequences,
                                          share=part_valid / max(valid_sequences, 1))
            part_tokens = int(mask.sum().item())
            with torch.no_grad():
                entropy_sum += float((entropy_from_logits(logits.detach()) * mask).sum().item())
            for key, value in stats.items():  # token-weighted means; maxima stay maxima
                if key.endswith("_max"):
                    merged[key] = max(merged.get(key, float("-inf")), float(value))
                else:
                    merged[key] = merged.get(key, 0.0) + float(value) * part_tokens
            tokens += part_tokens
        for key in merged:
            if not key.endswith("_max"):
                merged[key] /= max(tokens, 1)
        skipped = not self._finite_everywhere(loss)
        if skipped:
            if settings.nan_policy == "stop":
                raise NonFiniteError(
                    f"the loss of policy version {self.version + 1} is {loss.item()} on rank {self.rank} "
                    "(train.nan_policy: stop); no update was applied or published. Set train.nan_policy: skip "
                    "to skip such steps, or lower train.lr"
                )
            grad_norm = float("nan")  # no backward, no optimizer step: the weights stay as they were
        else:
            self.engine.backward(loss)
            own_norm = self._plain_grad_norm() if settings.zero_stage == 0 else None
            self.engine.step()
            grad_norm = self.engine.get_global_grad_norm() if own_norm is None else own_norm
        self.version += 1  # a skipped step still consumes its data and advances the version counter
        publish_seconds = self._publish() if self.joins_publish else 0.0
        return {
            "nonfinite_skipped": int(skipped),
            "policy_loss": loss.item(),  # rank losses average to the global loss (see _aggregate)
            "entropy": entropy_sum / max(tokens, 1),
            "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
            "num_tokens": tokens,
            "micro_batches": len(batches),
            "train_seconds": time.perf_counter() - start - publish_seconds,
            "publish_seconds": publish_seconds,
            **merged,
        }

    def _finite_everywhere(self, loss) -> bool:
        """True when the loss is finite on every rank (all ranks must agree to skip a step together)."""
        finite = self.torch.tensor([float(bool(self.torch.isfinite(loss.detach()).all()))])
        if self.world_size > 1:
            self.torch.distributed.all_reduce(finite, op=self.torch.distributed.ReduceOp.MIN)
        return bool(finite.item())

    def _plain_grad_norm(self) -> float:
        """Global gradient norm before clipping. Without ZeRO, DeepSpeed does not report it;
        gradients are already averaged over ranks after backward, so this is the global one."""
        grads = [p.grad.detach().float() for p in self.engine.module.parameters() if p.grad is not None]
        return float(self.torch.linalg.vector_norm(self.torch.stack([self.torch.linalg.vector_norm(g) for g in grads])))

    def state_dict(self) -> dict[str, np.ndarray]:
        return self._full_state_dict()

    def _full_state_dict(self) -> dict[str, np.ndarray]:
        """Full fp32 weights as numpy arrays (ZeRO-3 shards are gathered on every rank)."""
        module = self.engine.module
        params = list(module.parameters())
        gather = self.deepspeed.zero.GatheredParameters(params) if self.settings.zero_stage == 3 else contextlib.nullcontext()
        with gather:
            return {name: tensor.detach().float().cpu().numpy().copy() for name, tensor in module.state_dict().items()}

    def _publish(self) -> float:
        import ray

        start = time.perf_counter()
        weights = self._full_state_dict()  # every rank under ZeRO-3 (collective), else rank 0 only
        if self.store is None:
            return time.perf_counter() - start
        bad = [name for name, array in weights.items() if not np.isfinite(array).all()]
        if bad:  # never hand NaN weights to the generators (or to a checkpoint)
            raise NonFiniteError(
                f"policy version {self.version} has non-finite weights ({', '.join(bad[:3])}"
                f"{' ...' if len(bad) > 3 else ''}); it was not published. Resume from the last checkpoint "
                "with a lower train.lr or train.grad_clip"
            )
        weights_ref = ray.put(weights)
        ray.get(self.store.publish.remote(self.version, [weights_ref]))
        return time.perf_counter() - start

    # --- checkpoints ------------------------------------------------------------------------

    def save_checkpoint(self, folder: str) -> None:
        """Every rank: DeepSpeed engine state (model, optimizer, scheduler; its shard under ZeRO)
        into folder/engine, and this rank's RNG states into folder/rng/rank_N.json."""
        folder = Path(folder)
        self.engine.save_checkpoint(
            str(folder), tag="engine", client_state={"policy_version": self.version}, save_latest=False
        )
        (folder / "rng").mkdir(parents=True, exist_ok=True)
        (folder / "rng" / f"rank_{self.rank}.json").write_text(json.dumps(self._rng_state()))

    def load_checkpoint(self, folder: str, version: int) -> int:
        """Every rank: restore the engine and RNG states; rank 0 then publishes `version` so generators
        start from the checkpoint's weights. Returns the restored policy version."""
        folder = Path(folder)
        path, client_state = self.engine.load_checkpoint(
            str(folder), tag="engine", load_optimizer_states=True, load_lr_scheduler_states=True
        )
        if path is None:
            raise FileNotFoundError(f"no DeepSpeed engine state in {folder / 'engine'}")
        restored = int(client_state.get("policy_version", version))
        if restored != version:
            raise ValueError(f"{folder}: engine state is policy version {restored}, the checkpoint says {version}")
        rng_file = folder / "rng" / f"rank_{self.rank}.json"
        if rng_file.is_file():
            self._set_rng_state(json.loads(rng_file.read_text()))
        self.version = version
        if self.joins_publish and version > 0:
            self._publish()
        return version

    def _rng_state(self) -> dict:
        np_state = np.random.get_state()
        return {
            "torch": base64.b64encode(self.torch.get_rng_state().numpy().tobytes()).decode(),
            "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
            "python": [random.getstate()[0], list(random.getstate()[1]), random.getstate()[2]],
        }

    def _set_rng_state(self, state: dict) -> None:
        torch_state = np.frombuffer(base64.b64decode(state["torch"]), dtype=np.uint8).copy()
        self.torch.set_rng_state(self.torch.from_numpy(torch_state))
        kind, keys, *rest = state["numpy"]
        np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), *rest))
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))

    def save_pretrained(self, path: str, tokenizer: bool = False) -> str | None:
        """Write an HF checkpoint (rank 0 writes; every rank must call it under ZeRO-3), with the
        model folder's tokenizer when `tokenizer` (so the folder loads with from_pretrained / vLLM)."""
        state = self._full_state_dict()
        if self.rank != 0:
            return None
        self.engine.module.save_pretrained(path, state_dict={k: self.torch.from_numpy(v) for k, v in state.items()})
        if tokenizer:
            from transformers import AutoTokenizer

            AutoTokenizer.from_pretrained(
                self.settings.model_path, local_files_only=True, trust_remote_code=self.settings.trust_remote_code
            ).save_pretrained(path)
        return path

