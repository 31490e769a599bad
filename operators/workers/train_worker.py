"""One DeepSpeed rank of the trainer group, run as a Ray actor (see `pipelines.runtime.trainer_group`).

Each train step gets this rank's shard of the step's samples (the same number of samples
on every rank), computes the policy loss against the behaviour log-probs (with the
configured mismatch correction, KL to a reference and entropy bonus), takes
`ppo_epochs x mini_batches` optimizer steps of the DeepSpeed engine (ZeRO stage from
config, gradient clipping) and, on rank 0, publishes the new weights to the policy store.

A policy version counts train steps (batches), not optimizer steps: version v is the
policy after v train steps, however many optimizer steps each took. So the staleness
bound, the admission gate, checkpoints (policy version == steps done) and the ledger are
the same for every ppo_epochs / mini_batches.
"""

from __future__ import annotations

import base64
import inspect
import json
import math
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from operators.algorithms.batching import TokenBatch, token_batch, trained_tokens
from operators.algorithms.correction import CorrectionSettings
from operators.devices import dist_backend, local_device


def _ratio_range(log_ratio, mask) -> tuple[float, float]:
    """(min, max) of exp(log_ratio) over valid tokens; [B, T] inputs; (1, 1) when there are none."""
    from operators.algorithms.losses import bounded_exp

    values = bounded_exp(log_ratio[mask.bool()].double())  # [N]
    return (values.min().item(), values.max().item()) if values.numel() else (1.0, 1.0)


class _StatSums:
    """Token-weighted means of per-batch statistics; *_max keep the maximum, *_min the minimum."""

    def __init__(self):
        self.sums: dict[str, float] = {}
        self.tokens: dict[str, float] = {}

    def add(self, stats: dict, tokens: float) -> None:
        for key, value in stats.items():
            if key.endswith("_max"):
                self.sums[key] = max(self.sums.get(key, float("-inf")), float(value))
            elif key.endswith("_min"):
                self.sums[key] = min(self.sums.get(key, float("inf")), float(value))
            else:
                self.sums[key] = self.sums.get(key, 0.0) + float(value) * tokens
                self.tokens[key] = self.tokens.get(key, 0.0) + tokens

    def means(self) -> dict:
        return {key: value if key not in self.tokens else value / max(self.tokens[key], 1.0)
                for key, value in self.sums.items()}


def _libc_malloc_trim():
    """glibc's malloc_trim, or None where the C library is not glibc."""
    import ctypes
    import ctypes.util

    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


class NonFiniteError(RuntimeError):
    """The loss or the weights became NaN/inf and the job must stop (nothing was published)."""


@dataclass(frozen=True)
class LrSchedule:
    """The learning rate over optimizer steps, as a factor of the peak lr: a linear warm-up over
    `warmup_steps` (lr/warmup_steps, 2 lr/warmup_steps, ... lr), then constant, or a cosine that
    reaches `min_ratio` x lr at optimizer step `total_steps` (the job's last)."""

    warmup_steps: int = 0
    total_steps: int = 0
    kind: str = "constant"
    min_ratio: float = 0.0

    def factor(self, step: int) -> float:
        """The factor of optimizer step `step` (0 for the first)."""
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.kind == "cosine":
            span = max(self.total_steps - self.warmup_steps - 1, 1)
            progress = min(max((step - self.warmup_steps) / span, 0.0), 1.0)
            return self.min_ratio + (1.0 - self.min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
        return 1.0


@dataclass(frozen=True)
class TrainerSettings:
    """A rank's settings. pipelines/runtime/trainer_group.py maps the config onto them in one table; the defaults
    here equal the config's (tests/unit/test_config.py checks), for loops that build a rank by hand."""

    model_path: str
    lr: float = 2e-3
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
    max_new_tokens: int = 4
    trust_remote_code: bool = False
    micro_batch_tokens: int = 0
    logits_chunk_tokens: int = 2048  # log-probs of at most this many positions at once (0: all at once)
    gradient_checkpointing: bool = False
    weight_bucket_mb: float = 256  # the weight channel's bucket size (operators/weights.py)
    lr_schedule: LrSchedule = field(default_factory=LrSchedule)
    zero3_persistence_threshold: int | None = None  # DeepSpeed's default (1e5 elements) when None
    nan_policy: str = "skip"  # a non-finite loss: "skip" the step (weights unchanged) or "stop" the job
    clip_ratio_c: float = 3.0  # decoupled_ppo's dual-clip bound for negative advantages
    correction: CorrectionSettings = field(default_factory=CorrectionSettings)  # TIS / MIS on pi_prox / pi_behave
    kl_coef: float = 0.0  # weight of the KL-to-reference term (needs per-sample ref_logprobs)
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0  # weight of the entropy bonus (subtracted from the loss)
    ppo_epochs: int = 1  # passes over the step's samples
    mini_batches: int = 1  # optimizer steps per pass; each gets 1/mini_batches of the rank's samples


class TrainWorker:
    # What this rank trains, for messages: its role and the config section that sets it up.
    ROLE, SECTION = "policy", "train"
    # Per-token sample columns every sample must have (one float per response, or one per token).
    PER_TOKEN = ("behavior_logprobs", "advantages")
    # Per-token columns used when every sample of a micro-batch carries them.
    OPTIONAL_PER_TOKEN = ("proximal_logprobs", "ref_logprobs")

    def __init__(
        self, rank: int, world_size: int, master_port: int, settings: TrainerSettings, policy_store: str | None
    ):
        """`policy_store`: name of the store actor rank 0 publishes to; None to publish nowhere
        (a plain single-process loop pulls weights with `state_dict()` instead)."""
        import torch

        # The rank's device: the GPU Ray assigned to this actor (cuda:0, the only one it sees), else the CPU.
        self.device = local_device(torch, role=f"{self.ROLE} rank {rank}")
        os.environ.update({
            "MASTER_ADDR": os.environ.get("STREAMRL_MASTER_ADDR", "127.0.0.1"),
            "MASTER_PORT": str(master_port), "RANK": str(rank), "WORLD_SIZE": str(world_size),
            # One GPU per rank actor, so its local rank is 0; DeepSpeed's accelerator follows the device.
            "LOCAL_RANK": "0", "DS_ACCELERATOR": self.device.type,
        })
        import deepspeed

        # No JIT-compiled ops: the shared-memory comm op and fused Adam each cost 20-40 s to build on CPU.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        torch.set_num_threads(settings.torch_threads)
        torch.manual_seed(settings.seed)
        deepspeed.init_distributed(dist_backend=dist_backend(self.device.type))
        self.torch, self.deepspeed = torch, deepspeed
        self.rank, self.world_size, self.settings = rank, world_size, settings
        config = self.deepspeed_config(settings, world_size)
        # ZeRO-3: while this object lives, from_pretrained builds the model inside deepspeed.zero.Init,
        # so each parameter is partitioned as it is created and loaded: no rank ever holds the whole model.
        self._zero3_init = None
        if settings.zero_stage == 3:
            from transformers.integrations import HfDeepSpeedConfig

            self._zero3_init = HfDeepSpeedConfig(config)
        model = self._build_model(settings)
        if settings.gradient_checkpointing:
            model.config.use_cache = False
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        optimizer = torch.optim.AdamW(
            model.parameters(), lr=settings.lr, betas=settings.betas, weight_decay=settings.weight_decay
        )
        schedule = settings.lr_schedule
        # Stepped by DeepSpeed after each optimizer step; saved and restored with the engine's checkpoint.
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: schedule.factor(step))
        self.engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=config)
        self.pad_id = model.config.pad_token_id or 0
        self._lm_head = self._chunkable_head(model)
        self._malloc_trim = _libc_malloc_trim() if self.device.type == "cpu" else None  # see _release_host_memory
        self.store = None
        if rank == 0 and policy_store:  # Ray only with a store: a plain loop (benchmarks/gpu_smoke.py) has none
            import ray

            self.store = ray.get_actor(policy_store)
        # Under ZeRO-3 gathering the full weights is a collective: every rank takes part in a
        # publish, rank 0 alone sends them. (Small models hide this: DeepSpeed keeps parameters
        # below stage3_param_persistence_threshold whole on every rank, so nothing is gathered.)
        self.joins_publish = policy_store is not None and (rank == 0 or settings.zero_stage == 3)
        self.version = 0

    @staticmethod
    def deepspeed_config(settings: TrainerSettings, world_size: int) -> dict:
        """The DeepSpeed config of a rank. Batch sizes: a train step is `ppo_epochs x mini_batches`
        optimizer steps, each accumulating the gradients of a number of micro-batches that depends on the
        step's lengths (`micro_batch_tokens`), so the trainer marks the accumulation boundary itself
        (`set_gradient_accumulation_boundary`, DeepSpeed's public API for variable accumulation) and the
        fixed sizes below only satisfy DeepSpeed's batch-size check (train = micro x accumulation x ranks).
        bf16: DeepSpeed keeps fp32 master weights and optimizer state, the module computes in bf16."""
        zero = {"stage": settings.zero_stage}
        if settings.zero3_persistence_threshold is not None:
            zero["stage3_param_persistence_threshold"] = settings.zero3_persistence_threshold
        return {
            "train_batch_size": world_size,
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": settings.grad_clip,
            "zero_optimization": zero,
            "zero_allow_untested_optimizer": True,
            # check_grad_overflow (DeepSpeed's default, set here because the NaN guard relies on it): a step
            # whose gradient norm is not finite is skipped and its gradients dropped (_discard_gradients).
            "bf16": {"enabled": settings.dtype == "bf16", "check_grad_overflow": True},
            "steps_per_print": 10**9,
        }

    @staticmethod
    def _chunkable_head(model):
        """The LM head when log-probs can be computed from the final hidden states chunk by chunk, else None
        (then the trainer takes the model's full logits): the model must accept `logits_to_keep` and its
        logits must be the plain head of the last hidden state (no soft-capping or logit scale)."""
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        config = model.config
        plain = not any(getattr(config, key, None) for key in ("final_logit_softcapping", "logit_scale"))
        takes_keep = "logits_to_keep" in inspect.signature(model.forward).parameters
        return head if head is not None and plain and takes_keep else None

    def _build_model(self, settings: TrainerSettings):
        """The module this rank trains (fp32); a subclass may put another head on the backbone."""
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(
            settings.model_path, local_files_only=True, dtype=self.torch.float32,
            trust_remote_code=settings.trust_remote_code,
        )

    def ready(self) -> dict:
        """Where this rank runs (tests check placement)."""
        import ray

        return {"rank": self.rank, "node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid()}

    def _batch_tensors(self, samples: dict) -> TokenBatch:
        """The samples as a TokenBatch on this rank's device, with this role's PER_TOKEN columns and
        those of its OPTIONAL_PER_TOKEN that every sample has."""
        return token_batch(samples, self.pad_id, self.PER_TOKEN, self.OPTIONAL_PER_TOKEN, self.device)

    def _aggregate(self, per_token_loss, mask, global_tokens: int, global_sequences: int, share: float = 1.0):
        """Aggregate so that the DeepSpeed gradient average over ranks equals the global aggregate.

        Aggregations normalised by a global count (tokens, sequences) are sums over samples,
        so micro-batch losses add up exactly; one that averages over its own batch
        (seq_mean_token_mean) is weighted by `share`: the micro-batch's responses over the mini-batch's
        on all ranks, times the world size (DeepSpeed divides by it)."""
        from operators.algorithms.losses import LOSS_AGGREGATIONS

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
        lengths this removes most padding: short responses no longer pad to the longest one.

        Every rank gets the same number of micro-batches: under ZeRO-3 each forward gathers parameters
        and each backward reduces gradients with the other ranks, so the passes must pair up. A rank
        with fewer splits its largest ones; one with fewer samples than passes pads with empty
        micro-batches ([]), which run a pass of zero weight."""
        from operators.algorithms.batching import length_sorted_chunks, split_to_count

        count = len(samples["response_token_ids"])
        budget = self.settings.micro_batch_tokens
        if not budget:
            chunks = [list(range(count))] if count else []
        else:
            lengths = [len(p) + len(r) for p, r in zip(samples["prompt_token_ids"], samples["response_token_ids"])]
            chunks = length_sorted_chunks(lengths, budget)
        if self.world_size > 1:
            chunks = split_to_count(chunks, self._max_over_ranks(len(chunks)))
        return chunks

    def _micro_batch_tensors(self, samples: dict):
        """Yield (indices, batch tensors, last) for each of `micro_batches(samples)`. An empty micro-batch
        (a pass that pairs up with another rank's) gets the tensors of sample 0 and indices []: the
        caller gives it zero weight."""
        chunks = self.micro_batches(samples)
        for number, indices in enumerate(chunks, start=1):
            yield indices, self._batch_tensors(self._subset(samples, indices or [0])), number == len(chunks)

    def _max_over_ranks(self, value: int) -> int:
        torch = self.torch
        tensor = torch.tensor([value], dtype=torch.long, device=self.device)
        torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX)
        return int(tensor.item())

    def mini_batches(self, count: int, epoch: int) -> list[list[int]]:
        """This rank's sample indices per optimizer step of one epoch: `mini_batches` equal parts
        (config validation makes them divide `count`). One part keeps the arrival order; several are
        cut from a permutation drawn from (seed, policy version, epoch), so every epoch mixes them
        differently and a resumed run draws the same ones."""
        parts = self.settings.mini_batches
        order = np.arange(count)
        if parts > 1:
            order = np.random.default_rng([self.settings.seed, self.version, epoch]).permutation(count)
        return [part.tolist() for part in np.array_split(order, parts)]

    def _subset(self, samples: dict, indices: list[int]) -> dict:
        return {key: [values[i] for i in indices] if values is not None else None for key, values in samples.items()}

    def _forward(self, batch: TokenBatch, entropy_grad: bool = False):
        """Log-probs [B, L-1] of the batch's tokens under the trainer, at the sampling temperature, and
        the entropy [B, L-1] of each next-token distribution (with a graph only when `entropy_grad`).

        With `logits_chunk_tokens` set, the model returns its final hidden states (and the logits of one
        position only) and the log-probs are computed from them in chunks that are recomputed in backward
        (operators.algorithms.losses.chunked_token_logprobs): the fp32 [B, L, V] logits are never held at once."""
        from operators.algorithms.losses import chunked_token_logprobs, entropy_from_logits, token_logprobs

        torch, temperature, chunk = self.torch, self.settings.temperature, self.settings.logits_chunk_tokens
        ids, attention = batch.input_ids, batch.attention
        targets = ids[:, 1:]  # [B, L-1]
        rows, positions = targets.shape
        if self._lm_head is not None and chunk and rows * positions > chunk:
            out = self.engine(input_ids=ids, attention_mask=attention, output_hidden_states=True, logits_to_keep=1)
            hidden = out.hidden_states[-1][:, :-1]  # [B, L-1, H]: the last layer's (normed) state before each token
            return chunked_token_logprobs(hidden, self._lm_head, targets, temperature, max(1, chunk // rows),
                                          entropy_grad)
        logits = self.engine(input_ids=ids, attention_mask=attention).logits[:, :-1].float() / temperature  # [B, L-1, V]
        if entropy_grad:
            return token_logprobs(logits, targets), entropy_from_logits(logits)
        with torch.no_grad():
            entropy = entropy_from_logits(logits.detach())  # [B, L-1], a metric only
        return token_logprobs(logits, targets), entropy

    def _proximal_logprobs(self, samples: dict) -> list[np.ndarray]:
        """pi_prox: this rank's log-probs of every response token before the step's first update
        (no grad), one array per sample; needed when the step takes several optimizer steps."""
        proximal = [None] * len(samples["response_token_ids"])
        with self.torch.no_grad():
            for indices, batch, _ in self._micro_batch_tensors(samples):  # an empty one still runs its forward
                logprobs, _ = self._forward(batch)
                for row, index in enumerate(indices):
                    proximal[index] = batch.at_response(logprobs, row).cpu().numpy().astype(np.float64)
        return proximal

    def _global_counts(self, parts: list[list[int]], samples: dict) -> list[tuple[float, float]]:
        """(valid tokens, responses with tokens) of each mini-batch summed over ranks: the
        normalisers of its loss, so that every optimizer step sees a global aggregate."""
        torch = self.torch
        counts = torch.tensor([[float(sum(trained_tokens(samples, i) for i in part)),
                                float(sum(1 for i in part if trained_tokens(samples, i)))]
                               for part in parts], dtype=torch.float64, device=self.device)  # [M, 2]
        if self.world_size > 1:
            torch.distributed.all_reduce(counts)
        return [(float(tokens), float(sequences)) for tokens, sequences in counts.tolist()]

    def _loss(self, part: dict, global_tokens: float, global_sequences: float, first_epoch: bool,
              stats: _StatSums, mismatch: list, valid_sequences: float):
        """Yield (loss, last) for each micro-batch of one mini-batch (the losses sum to the mini-batch's
        loss), each computed just before its backward, so one micro-batch's graph is alive at a time.
        Statistics go into `stats` and `mismatch` as each micro-batch is computed. `valid_sequences`: the
        mini-batch's responses with tokens, over all ranks (an aggregation that averages over its own
        batch weighs each micro-batch by its share of them, so ranks of unequal size still add up)."""
        from operators.algorithms.correction import (
            behavior_log_ratio,
            correction_factors,
            mismatch_sums,
        )
        from operators.algorithms.losses import (
            KL_ESTIMATORS,
            POLICY_LOSSES,
            kl_k3,
        )

        settings = self.settings
        loss_fn = POLICY_LOSSES.get(settings.policy_loss)
        accepted = inspect.signature(loss_fn).parameters
        for indices, batch, last in self._micro_batch_tensors(part):
            mask = batch.mask  # [B, L-1]
            behavior, advantages = batch.require("behavior_logprobs", "advantages")  # [B, L-1] each
            logprobs, entropy = self._forward(batch, entropy_grad=bool(settings.entropy_coef))  # [B, L-1] each
            # pi_prox: fixed before the first of several updates, else the current policy (no extra forward).
            proximal = batch.proximal_logprobs if batch.proximal_logprobs is not None else logprobs.detach()  # [B, L-1]
            options = {"proximal_logprobs": proximal, "clip_eps_low": settings.clip_eps_low,
                       "clip_eps_high": settings.clip_eps_high, "clip_ratio_c": settings.clip_ratio_c}
            per_token_loss, loss_stats = loss_fn(logprobs, behavior, advantages, mask,
                                                 **{k: v for k, v in options.items() if k in accepted})
            log_rho = behavior_log_ratio(proximal, behavior, mask)  # [B, L-1]
            factor, truncated, masked = correction_factors(log_rho, mask, settings.correction)  # [B, L-1] each
            per_token_loss = per_token_loss * factor - settings.entropy_coef * entropy  # [B, L-1]
            tokens = float(mask.sum().item())
            if batch.ref_logprobs is not None:
                kl = KL_ESTIMATORS.get(settings.kl_estimator)(logprobs, batch.ref_logprobs)  # [B, L-1]
                per_token_loss = per_token_loss + settings.kl_coef * kl
                loss_stats["kl_ref"] = float((kl_k3(logprobs.detach(), batch.ref_logprobs) * mask).sum()) / max(tokens, 1)
            part_valid = sum(1 for i in indices if trained_tokens(part, i))
            loss = self._aggregate(per_token_loss, mask, global_tokens, global_sequences,
                                   share=part_valid * self.world_size / max(valid_sequences, 1))
            if not indices:
                yield loss * 0.0, last
                continue
            if first_epoch:  # pi_prox is fixed for the step: measure the mismatch once per sample
                mismatch.append(mismatch_sums(log_rho, mask, batch.staleness, truncated, masked))
            loss_stats["entropy"] = float((entropy.detach() * mask).sum()) / max(tokens, 1)
            # pi_theta / pi_behave, whatever the loss's own ratio is centred on
            loss_stats["ratio_behavior_min"], loss_stats["ratio_behavior_max"] = _ratio_range(
                logprobs.detach() - behavior, mask)
            stats.add(loss_stats, tokens)
            yield loss, last

    def train_step(self, samples: dict, global_tokens: int, global_sequences: int) -> dict:
        """One train step on this rank's shard: ppo_epochs x mini_batches optimizer steps; rank 0
        then publishes version + 1 (a version counts train steps, see the module docstring).

        Each mini-batch may be split into micro-batches (`micro_batch_tokens`), each with its own
        forward and backward; their gradients accumulate into one optimizer step, which equals the
        unsplit one (up to float reassociation) under every loss aggregation and ZeRO stage. `global_tokens` and
        `global_sequences` count the whole step over all ranks (the normalisers of a one-mini-batch
        step; several mini-batches sum their own counts over the ranks). With several updates, the
        proximal log-probs are computed once before the first.

        Optional per-sample columns: `staleness` (train_step - policy_version; 0 when absent),
        `ref_logprobs` (one per response token; required when kl_coef > 0)."""
        settings = self.settings
        start = time.perf_counter()
        self.engine.train()
        count = len(samples["advantages"])
        if not count:
            raise ValueError("train_step got no samples")
        if settings.kl_coef > 0 and any(ref is None for ref in samples.get("ref_logprobs") or [None]):
            raise ValueError(
                f"algorithm.kl_coef is {settings.kl_coef} but samples carry no ref_logprobs (one reference "
                "log-prob per response token); add the reference-model stage to the job or set algorithm.kl_coef: 0"
            )
        samples = dict(samples)
        updates = settings.ppo_epochs * settings.mini_batches
        if updates > 1:
            samples["proximal_logprobs"] = self._proximal_logprobs(samples)
        stats, mismatch = _StatSums(), []

        def loss_of(part: dict, tokens: float, sequences: float, epoch: int, valid: float):
            return self._loss(part, tokens, sequences, epoch == 0, stats, mismatch, valid)

        losses, grad_norms, skipped, passes, empty = self._updates(
            samples, count, global_tokens, global_sequences, loss_of,
            lambda value: f"the loss of policy version {self.version + 1} is {value} on rank {self.rank} "
                          "(train.nan_policy: stop); no update was applied or published. Set "
                          "train.nan_policy: skip to skip such steps, or lower train.lr",
        )
        self.version += 1  # a skipped step still consumes its data and advances the version counter
        publish_seconds = self._publish() if self.joins_publish else 0.0
        return {
            "nonfinite_skipped": int(skipped),
            # mean over the optimizer steps (non-finite when one was; NaN when none ran); rank losses average to
            # the global loss
            "policy_loss": float(np.mean(losses)) if losses else float("nan"),
            "empty_updates": empty,  # optimizer steps skipped: their mini-batch had no trained token on any rank
            "grad_norm": grad_norms[0] if grad_norms else float("nan"),  # the first update's, before clipping
            "grad_norm_last": grad_norms[-1] if grad_norms else float("nan"),
            "optimizer_steps": len(grad_norms),
            "num_tokens": sum(trained_tokens(samples, i) for i in range(count)),
            "micro_batches": passes // max(len(losses), 1),  # forward/backward passes per optimizer step
            "train_seconds": time.perf_counter() - start - publish_seconds,
            "publish_seconds": publish_seconds,
            "mismatch": mismatch,  # merged over ranks by the Train operator (operators.algorithms.correction.merge_mismatch)
            **stats.means(),
        }

    def _updates(self, samples: dict, count: int, global_tokens: float, global_sequences: float, loss_of,
                 stop_message) -> tuple[list[float], list[float], bool, int, int]:
        """The step's optimizer steps: `ppo_epochs` passes over `mini_batches` mini-batches. For each,
        `loss_of(part, tokens, sequences, epoch, valid_sequences)` yields (loss, last) per micro-batch (the same number on
        every rank); each gets its own backward, the gradients accumulate, and the last backward is the
        accumulation boundary before the optimizer step.

        Before each backward the ranks agree that the loss is finite. One that is not, on any rank, ends
        the step: the gradients accumulated for this optimizer step are dropped (the optimizer steps
        already taken stay applied), or it raises with `stop_message(value)` under nan_policy: stop.

        A mini-batch with no trained token on any rank (every episode's reset failed, say) has nothing to
        learn from and no normaliser: its optimizer step is skipped on every rank (they share the global
        counts) and counted. Returns the losses, the gradient norms, whether the step was cut short, the
        number of passes and the number of optimizer steps skipped as empty."""
        settings = self.settings
        losses, grad_norms, passes, empty = [], [], 0, 0
        for epoch in range(settings.ppo_epochs):
            parts = self.mini_batches(count, epoch)
            summed = self._global_counts(parts, samples)  # (tokens, responses with tokens) over the ranks
            counts = [(global_tokens, global_sequences)] if settings.mini_batches == 1 else summed
            for part_indices, (tokens, sequences), (_, valid) in zip(parts, counts, summed):
                if tokens <= 0:
                    empty += 1
                    continue
                total, accumulated = 0.0, 0
                for loss, last in loss_of(self._subset(samples, part_indices), tokens, sequences, epoch, valid):
                    passes += 1
                    if not self._finite_everywhere(loss):
                        losses.append(loss.item())
                        if accumulated:
                            self._discard_gradients(loss)
                        if settings.nan_policy == "stop":
                            raise NonFiniteError(stop_message(losses[-1]))
                        return losses, grad_norms, True, passes, empty
                    accumulated += 1
                    self.engine.set_gradient_accumulation_boundary(last)
                    self.engine.backward(loss)
                    total += loss.item()
                    del loss
                    self._release_host_memory()
                losses.append(total)
                grad_norms.append(self._optimizer_step())
        return losses, grad_norms, False, passes, empty

    def _release_host_memory(self) -> None:
        """On a CPU rank, hand the memory freed by a micro-batch's backward back to the OS. glibc keeps
        freed blocks below its (self-raising) mmap threshold in its heap, so without this a step of many
        micro-batches of varying shapes grows the resident memory with the number of micro-batches
        (measured: +2.3 GiB from 3 to 11 micro-batches, benchmarks/train_memory.py). GPU memory is the
        CUDA caching allocator's and is not affected."""
        if self._malloc_trim is not None:
            self._malloc_trim(0)

    def _optimizer_step(self) -> float:
        """One DeepSpeed optimizer step on the accumulated gradients (the last backward was the
        accumulation boundary); the global gradient norm before clipping."""
        own_norm = self._plain_grad_norm() if self.settings.zero_stage == 0 else None
        self.engine.step()
        grad_norm = self.engine.get_global_grad_norm() if own_norm is None else own_norm
        return float(grad_norm) if grad_norm is not None else float("nan")

    def _discard_gradients(self, loss) -> None:
        """Drop the gradients accumulated for an optimizer step that will not be taken, because the
        micro-batch `loss` (non-finite on some rank) came after others were backwarded. Every rank calls it.

        Without ZeRO the module's gradients are all there is: the engine's zero_grad drops them. ZeRO keeps
        reduced gradient partitions of its own, with no public call to drop them, so this uses DeepSpeed's
        own skip: every rank backwards the non-finite loss (NaN where it is finite) as the accumulation
        boundary, and DeepSpeed's step finds a non-finite gradient norm, skips the update, clears its
        gradients and leaves the LR schedule where it was (ZeRO 1-2 in fp32 and ZeRO 3 always; ZeRO 1-2
        in bf16 with `bf16.check_grad_overflow`, which the config sets)."""
        if not self.settings.zero_stage:
            self.engine.zero_grad()
            return
        poisoned = loss * float("nan") if bool(self.torch.isfinite(loss.detach())) else loss
        self.engine.set_gradient_accumulation_boundary(True)
        self.engine.backward(poisoned)
        self.engine.step()
        if getattr(self.engine.optimizer, "overflow", False) is not True:  # DeepSpeed changed: never train on it
            raise NonFiniteError(
                f"{self.ROLE} rank {self.rank}: DeepSpeed did not skip an optimizer step with a non-finite gradient "
                f"(ZeRO {self.settings.zero_stage}); the weights may be damaged. Resume from the last checkpoint"
            )

    def _finite_everywhere(self, loss) -> bool:
        """True when the loss is finite on every rank (all ranks must agree to skip a step together)."""
        finite = self.torch.tensor([float(bool(self.torch.isfinite(loss.detach()).all()))], device=self.device)
        if self.world_size > 1:
            self.torch.distributed.all_reduce(finite, op=self.torch.distributed.ReduceOp.MIN)
        return bool(finite.item())

    def _plain_grad_norm(self) -> float:
        """Global gradient norm before clipping. Without ZeRO, DeepSpeed does not report it;
        gradients are already averaged over ranks after backward, so this is the global one."""
        grads = [p.grad.detach().float() for p in self.engine.module.parameters() if p.grad is not None]
        return float(self.torch.linalg.vector_norm(self.torch.stack([self.torch.linalg.vector_norm(g) for g in grads])))

    def state_dict(self) -> dict[str, np.ndarray]:
        """Full fp32 weights as numpy arrays, on every rank (ZeRO-3: every rank must call it)."""
        return self._full_state_dict(everywhere=True)

    def _named_weights(self):
        """(name, tensor) for every state-dict entry, one module at a time; under ZeRO-3 each module's
        parameters are gathered for the duration (a collective: every rank must iterate it)."""
        from operators.weights import named_weights

        gathered = self.deepspeed.zero.GatheredParameters if self.settings.zero_stage == 3 else None
        return named_weights(self.engine.module, gathered)

    def _full_state_dict(self, everywhere: bool = False) -> dict[str, np.ndarray]:
        """Full fp32 weights as numpy arrays (ZeRO-3: gathered module by module, and every rank must call
        it; ranks other than 0 get {} unless `everywhere`)."""
        keep = everywhere or self.rank == 0 or self.settings.zero_stage != 3
        return {name: tensor.float().cpu().numpy().copy() for name, tensor in self._named_weights() if keep}

    def weight_buckets(self):
        """The weights in the training dtype (the module's: bf16 under train.dtype bf16), bucketed."""
        from operators.weights import pack_buckets

        return pack_buckets(self._named_weights(), self.settings.weight_bucket_mb)

    def _publish(self) -> float:
        """Send this version's weights through the weight channel (operators/weights.py) and publish its
        manifest. Every rank under ZeRO-3 walks the modules (the gathers are collectives); rank 0 sends."""
        start = time.perf_counter()
        if self.store is None:  # a ZeRO-3 rank other than 0: take part in the gathers, send nothing
            for _ in self._named_weights():
                pass
            return time.perf_counter() - start
        import ray

        from operators.weights import ObjectStoreTransport

        manifest, bad = ObjectStoreTransport().send(self.weight_buckets())
        if bad:  # never hand NaN weights to the generators (or to a checkpoint)
            raise NonFiniteError(
                f"{self.ROLE} version {self.version} has non-finite weights ({', '.join(bad[:3])}"
                f"{' ...' if len(bad) > 3 else ''}); it was not published. Resume from the last checkpoint "
                f"with a lower {self.SECTION}.lr or {self.SECTION}.grad_clip"
            )
        ray.get(self.store.publish.remote(self.version, [ray.put(manifest)]))
        self.last_publish = {"bytes": manifest.nbytes, "buckets": len(manifest.handles), "dtype": manifest.dtype}
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
        state = self._full_state_dict()  # every rank under ZeRO-3 (collective); {} except on rank 0
        if self.rank != 0:
            return None
        self.engine.module.save_pretrained(path, state_dict={k: self.torch.from_numpy(v) for k, v in state.items()})
        if tokenizer:
            from transformers import AutoTokenizer

            AutoTokenizer.from_pretrained(
                self.settings.model_path, local_files_only=True, trust_remote_code=self.settings.trust_remote_code
            ).save_pretrained(path)
        return path

