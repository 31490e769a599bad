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

import functools
import os
import time
from contextlib import contextmanager, nullcontext

import numpy as np

from operators.algorithms.batching import TokenBatch, check_packing, split_to_count, token_batch, trained_token_counts
from operators.algorithms.columns import Ragged, as_ragged, is_complete, lengths
from operators.algorithms.correction import mismatch_sums
from operators.algorithms.loss_composition import StatSums, add_policy_stats, policy_token_loss, rank_aggregate
from operators.algorithms.losses import entropy_from_logits, token_logprobs
from operators.algorithms.shared_prompts import check_shared_prompts, step_width_limit
from operators.algorithms.step_batch import micro_batch_chunks, mini_batch_parts, subset
from operators.common.devices import local_device
from operators.algorithms.logprobs import chunkable_head, chunked_logprobs
from operators.weights.buckets import named_weights
from operators.weights.lora_merge import adapter_weights, merged_weights
from operators.weights.probe import served_probe
from operators.weights.publisher import Publisher
from operators.workers.checkpointer import Checkpointer
from operators.workers.deepspeed_setup import (build_engine, deepspeed_config, host_memory_release, rendezvous_env,
                                               start_deepspeed, zero3_init)
from operators.workers.engine_steps import gathered_head, max_over_ranks, optimizer_steps
from operators.workers.lora import adapters_disabled, add_adapters, save_adapter
from operators.workers.settings import TrainerSettings


class TrainWorker:
    """A policy rank. Set-up: operators/workers/deepspeed_setup.py; the engine's optimizer step and NaN
    protocol: engine_steps.py; the loss maths: operators/algorithms/loss_composition.py; the batch cutting:
    operators/algorithms/step_batch.py. Its parts, held as objects and given what they use: `publisher`
    (operators/weights/publisher.py: the weights to the generators and the policy store) and `checkpointer`
    (checkpointer.py: checkpoints, RNG states, full state dicts, the HF export)."""

    # What this rank trains, for messages: its role and the config section that sets it up.
    ROLE, SECTION = "policy", "train"
    # Per-token sample columns every sample must have (one float per response, or one per token).
    PER_TOKEN = ("behavior_logprobs", "advantages")
    # Per-token columns used when every sample of a micro-batch carries them.
    OPTIONAL_PER_TOKEN = ("proximal_logprobs", "ref_logprobs")

    def __init__(
        self, rank: int, world_size: int, master_port: int, settings: TrainerSettings, policy_store=None
    ):
        """`policy_store`: the handle of the store actor (the weight channel) rank 0 publishes to, passed in by
        whoever made it (pipelines/runtime/policy_store.py); None: a plain loop pulls weights with `state_dict()`."""
        import torch

        # The rank's device: the GPU Ray assigned to this actor (cuda:0, the only one it sees), else the CPU.
        self.device = local_device(torch, role=f"{self.ROLE} rank {rank}")
        rendezvous_env(rank, world_size, master_port, self.device.type)
        deepspeed = start_deepspeed(torch, settings, self.device.type)
        self.torch, self.deepspeed = torch, deepspeed
        self.rank, self.world_size, self.settings = rank, world_size, settings
        config = deepspeed_config(settings, world_size)
        # ZeRO-3: kept alive with the model, so that it is built partitioned (deepspeed_setup.zero3_init).
        self._zero3_init = zero3_init(settings, config)
        model = self._build_model(settings)
        if settings.lora is not None:  # train.lora: only the adapters train; the weights served are merged
            model = add_adapters(torch, model, settings.lora, settings.seed)
        self.engine = build_engine(torch, deepspeed, model, settings, config)
        self.pad_id = model.config.pad_token_id or 0
        self._one_row = check_packing(model, settings.packing, self.SECTION)  # flash-attention: one packed row
        self._shared_mask = check_shared_prompts(model, settings.share_prompts, settings.packing)  # None: not shared (train.share_prompts for both roles)
        self._lm_head = chunkable_head(model)
        self._release_host_memory = host_memory_release(self.device.type)  # after each backward (a CPU rank's)
        self.version = 0  # the policy version: train steps done (see the module docstring)
        # The weight walk: (name, tensor) for every state-dict entry, one module at a time; under ZeRO-3 each
        # module's parameters are gathered for the duration (a collective: every rank must iterate it, so every
        # rank joins a publish and rank 0 alone sends); with LoRA, the adapted layers merged (lora_merge.py).
        gathered = deepspeed.zero.GatheredParameters if settings.zero_stage == 3 else None
        self._named_weights = functools.partial(named_weights if settings.lora is None else merged_weights,
                                                self.engine.module, gathered)  # given to the parts
        sent = functools.partial(adapter_weights, self.engine.module, gathered) if settings.serve_adapters else None
        self.publisher = Publisher(  # Ray only with a store: a plain loop (benchmarks/gpu_smoke.py) has none
            policy_store if rank == 0 else None, sent or self._named_weights,  # rollout.lora_adapters: adapters alone
            joins=policy_store is not None and (rank == 0 or settings.zero_stage == 3),
            bucket_mb=settings.weight_bucket_mb, transfer=settings.weight_transfer,
            timeout_s=settings.weight_timeout_s, verify_every=settings.verify_weights_every,
            role=self.ROLE, section=self.SECTION, pin_memory=self.device.type == "cuda",
            probe=served_probe(torch, self.engine.module, self.device, settings)  # what the engines must match
            if self.ROLE == "policy" and policy_store is not None else None)
        self.checkpointer = Checkpointer(
            self.engine, torch, rank, self._named_weights, partitioned=settings.zero_stage == 3,
            model_path=settings.model_path, trust_remote_code=settings.trust_remote_code,
            adapter=functools.partial(save_adapter, self.engine.module, gathered, settings.model_path, rank)
            if settings.lora else None)
        self.initialised_at = time.time()  # wall clock: when this rank was up (the job's start-up report)

    def _build_model(self, settings: TrainerSettings):
        """The module this rank trains, in the training dtype; a subclass may put another head on the backbone."""
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(
            settings.model_path, local_files_only=True, dtype=self.module_dtype(),
            trust_remote_code=settings.trust_remote_code,
        )

    def module_dtype(self):
        """The dtype the module is loaded in: the training dtype. Under bf16 DeepSpeed computes in a bf16
        module and keeps the fp32 master weights in its optimizer (cast from the module's bf16 weights), so
        loading in bf16 gives the same masters without a whole fp32 model on every rank first (ZeRO 1-2;
        ZeRO-3 builds the model partitioned, in the config's dtype, either way)."""
        return self.torch.bfloat16 if self.settings.dtype == "bf16" else self.torch.float32

    def ready(self) -> dict:
        """Where this rank runs (tests check placement), and when it was up (wall clock)."""
        import ray

        return {"rank": self.rank, "node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid(),
                "initialised_at": self.initialised_at}

    # --- weights and checkpoints (the parts: publisher, checkpointer) --------------------------------

    def state_dict(self) -> dict[str, np.ndarray]:
        """Full fp32 weights as numpy arrays, on every rank (ZeRO-3: every rank must call it)."""
        return self.checkpointer.full_state_dict(everywhere=True, as_numpy=True)

    def weight_buckets(self):
        """The weights in the training dtype (the module's: bf16 under train.dtype bf16), bucketed."""
        return self.publisher.buckets()

    def _publish(self) -> float:
        """Publish this rank's policy version (publisher.publish); the seconds this rank was held."""
        return self.publisher.publish(self.version)

    def save_checkpoint(self, folder: str) -> None:
        """Every rank: DeepSpeed engine state (model, optimizer, scheduler; its shard under ZeRO)
        into folder/engine, and this rank's RNG states into folder/rng/rank_N.json."""
        self.checkpointer.save(folder, self.version)

    def load_checkpoint(self, folder: str, version: int) -> int:
        """Every rank: restore the engine and RNG states; rank 0 then publishes `version` so generators
        start from the checkpoint's weights. Returns the restored policy version."""
        self.version = self.checkpointer.load(folder, version)
        if version > 0:
            self._publish()
        return version

    def save_pretrained(self, path: str, tokenizer: bool = False) -> str | None:
        """Write an HF checkpoint in the training dtype, rank 0 writes; every rank must call it under ZeRO-3.
        With the model folder's tokenizer when `tokenizer` (checkpointer.save_pretrained)."""
        return self.checkpointer.save_pretrained(path, tokenizer)

    # --- the step -------------------------------------------------------------------------------

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
        `ref_logprobs` (one per response token; required when kl_coef > 0, unless computed here: reference_on_trainer)."""
        settings = self.settings
        # plumbing: timing, train mode, input checks
        start = time.perf_counter()
        self.engine.train()
        count = len(samples["advantages"])
        if not count:
            raise ValueError("train_step got no samples")
        samples = dict(samples)
        if settings.reference_on_trainer:  # algorithm: pi_ref is this model with its LoRA adapters off
            samples["ref_logprobs"] = self._frozen_logprobs(samples, reference=True)
        refs = samples.get("ref_logprobs")
        if settings.kl_coef > 0 and (refs is None or not len(refs) or not is_complete(refs)):
            raise ValueError(
                f"algorithm.kl_coef is {settings.kl_coef} but samples carry no ref_logprobs (one reference "
                "log-prob per response token); add the reference-model stage to the job or set algorithm.kl_coef: 0"
            )
        # algorithm: pi_prox, fixed before the first of several updates (decoupled PPO); one update uses pi_theta
        if settings.ppo_epochs * settings.mini_batches > 1:
            samples["proximal_logprobs"] = self._frozen_logprobs(samples)
        stats, mismatch = StatSums(), []

        def loss_of(part: dict, tokens: float, sequences: float, epoch: int, valid: float):
            return self._policy_loss(part, tokens, sequences, epoch == 0, stats, mismatch, valid)

        # algorithm: ppo_epochs x mini_batches optimizer steps on the composed policy loss
        losses, grad_norms, skipped, passes, empty = self._updates(
            samples, count, global_tokens, global_sequences, loss_of,
            lambda value: f"the loss of policy version {self.version + 1} is {value} on rank {self.rank} "
                          "(train.nan_policy: stop); no update was applied or published. Set "
                          "train.nan_policy: skip to skip such steps, or lower train.lr",
        )
        # plumbing: the version, the publish to the generators, the rank's figures
        self.version += 1  # a skipped step still consumes its data and advances the version counter
        publish_seconds = self._publish()  # 0.0 on a rank that does not join a publish
        return {
            "nonfinite_skipped": int(skipped),
            # mean over the optimizer steps (non-finite when one was; NaN when none ran); rank losses average to
            # the global loss
            "policy_loss": float(np.mean(losses)) if losses else float("nan"),
            "empty_updates": empty,  # optimizer steps skipped: their mini-batch had no trained token on any rank
            "grad_norm": grad_norms[0] if grad_norms else float("nan"),  # the first update's, before clipping
            "grad_norm_last": grad_norms[-1] if grad_norms else float("nan"),
            "optimizer_steps": len(grad_norms),
            "num_tokens": int(trained_token_counts(samples).sum()),
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
        settings, empty = self.settings, [0]

        def schedule():  # algorithm: each epoch's mini-batches and their normalisers (global over the ranks)
            for epoch in range(settings.ppo_epochs):
                parts = self.mini_batches(count, epoch)
                summed = self._global_counts(parts, samples)  # (tokens, responses with tokens) over the ranks
                counts = [(global_tokens, global_sequences)] if settings.mini_batches == 1 else summed
                for indices, (tokens, sequences), (_, valid) in zip(parts, counts, summed):
                    if tokens <= 0:  # algorithm: nothing to learn from, no normaliser: skip the optimizer step
                        empty[0] += 1
                        continue
                    yield indices, tokens, sequences, epoch, valid

        # plumbing: the optimizer steps, gradient accumulation and the NaN protocol (engine_steps.py)
        losses, grad_norms, cut_short, passes = optimizer_steps(
            self.torch, self.engine, schedule(), lambda indices, *counts: loss_of(subset(samples, indices), *counts),
            stop_message, self._release_host_memory, zero_stage=settings.zero_stage,
            nan_policy=settings.nan_policy, device=self.device, world_size=self.world_size,
            who=f"{self.ROLE} rank {self.rank}")
        return losses, grad_norms, cut_short, passes, empty[0]

    def _policy_loss(self, part: dict, global_tokens: float, global_sequences: float, first_epoch: bool,
                     stats: StatSums, mismatch: list, valid_sequences: float):
        """Yield (loss, last) for each micro-batch of one mini-batch (the losses sum to the mini-batch's
        loss), each computed just before its backward, so one micro-batch's graph is alive at a time.
        Statistics go into `stats` and `mismatch` as each micro-batch is computed. `valid_sequences`: the
        mini-batch's responses with tokens, over all ranks (an aggregation that averages over its own
        batch weighs each micro-batch by its share of them, so ranks of unequal size still add up)."""
        settings = self.settings
        trains = trained_token_counts(part) > 0  # [part size]: responses with a trained token
        for indices, batch, last in self._micro_batch_tensors(part):
            # plumbing: open until this micro-batch's backward is done (under ZeRO-3 the LM head stays gathered)
            with self._logprobs(batch, entropy_grad=bool(settings.entropy_coef)) as (logprobs, entropy):  # [B, L-1] each
                mask = batch.mask  # [B, L-1]
                behavior, advantages = batch.require("behavior_logprobs", "advantages")  # [B, L-1] each
                # algorithm: pi_prox: fixed before the first of several updates, else the current policy (no extra forward).
                proximal = batch.proximal_logprobs if batch.proximal_logprobs is not None else logprobs.detach()  # [B, L-1]
                # algorithm: policy loss x mismatch correction - entropy bonus + KL to the reference (loss_composition.py)
                per_token_loss, loss_stats, (log_rho, truncated, masked) = policy_token_loss(
                    settings, logprobs, entropy, behavior, advantages, mask, proximal, batch.ref_logprobs)
                # algorithm: aggregate so that micro-batches add up and ranks average to the global aggregate
                part_valid = int(trains[indices].sum())
                loss = rank_aggregate(settings.loss_aggregation, per_token_loss, mask, global_tokens, global_sequences,
                                      self.world_size, settings.max_new_tokens,
                                      share=part_valid * self.world_size / max(valid_sequences, 1))
                if not indices:  # plumbing: a pass that pairs up with another rank's, of zero weight
                    yield loss * 0.0, last
                    continue
                # plumbing: statistics
                if first_epoch:  # pi_prox is fixed for the step: measure the mismatch once per sample
                    mismatch.append(mismatch_sums(log_rho, mask, batch.staleness, truncated, masked))
                add_policy_stats(loss_stats, logprobs, entropy, behavior, mask)
                stats.add(loss_stats, float(mask.sum().item()))
                yield loss, last

    @contextmanager
    def _logprobs(self, batch: TokenBatch, entropy_grad: bool = False):
        """A context that gives the log-probs [B, L-1] of the batch's tokens under the trainer, at the
        sampling temperature, and the entropy [B, L-1] of each next-token distribution (with a graph only
        when `entropy_grad`). The backward of a loss computed from them runs inside it.

        With `logits_chunk_tokens` set, the model returns its final hidden states (and the logits of one
        position only) and the log-probs are computed from them in chunks that are recomputed in backward
        (operators/algorithms/logprobs.py: chunked_logprobs): the fp32 [B, L, V] logits are never held at once. Under
        ZeRO-3 the LM head is gathered once for the chunks, their recomputes and its gradient, and stays
        gathered until the context exits (engine_steps.gathered_head); the model's own forward fetches it
        once more for the one position it computes."""
        torch, temperature, chunk = self.torch, self.settings.temperature, self.settings.logits_chunk_tokens
        inputs, targets = batch.model_inputs(), batch.targets()  # targets [B, L-1] padded, [P, W-1] packed
        rows, positions = targets.shape
        if self._lm_head is not None and chunk and rows * positions > chunk:  # plumbing: memory, same numbers
            out = self.engine(**inputs, output_hidden_states=True, logits_to_keep=1)
            hidden = batch.outputs(out.hidden_states[-1])  # [B, L-1, H]: the last layer's (normed) state before each token
            with gathered_head(self.deepspeed, self._lm_head, self.settings.zero_stage):
                logprobs, entropy = chunked_logprobs(hidden, self._lm_head, targets, temperature, chunk, entropy_grad)
                yield batch.unpack(logprobs), batch.unpack(entropy)  # [B, L-1] each (packed: unpacked per sequence)
            return
        # algorithm: log pi_theta at the sampling temperature
        logits = batch.outputs(self.engine(**inputs).logits).float() / temperature  # [B, L-1, V] ([P, W-1, V] packed)
        if entropy_grad:
            yield batch.unpack(token_logprobs(logits, targets)), batch.unpack(entropy_from_logits(logits))
            return
        with torch.no_grad():
            entropy = entropy_from_logits(logits.detach())  # a metric only
        yield batch.unpack(token_logprobs(logits, targets)), batch.unpack(entropy)

    def _frozen_logprobs(self, samples: dict, reference: bool = False) -> Ragged:
        """pi_prox: this rank's log-probs of every response token before the step's first update (no grad), one row
        per sample (several optimizer steps); with `reference`, pi_ref: the LoRA adapters off (reference.on_trainer)."""
        proximal = [None] * len(samples["response_token_ids"])
        with self.torch.no_grad(), adapters_disabled(self.engine.module) if reference else nullcontext():
            for indices, batch, _ in self._micro_batch_tensors(samples):  # an empty one still runs its forward
                with self._logprobs(batch) as (logprobs, _):  # no backward to wait for
                    for row, index in enumerate(indices):
                        proximal[index] = batch.at_response(logprobs, row).cpu().numpy().astype(np.float64)
        return Ragged.from_rows(proximal, np.float64)

    # --- batches over the ranks (plumbing around operators/algorithms/step_batch.py) -----------------

    def mini_batches(self, count: int, epoch: int) -> list[list[int]]:
        """This rank's sample indices per optimizer step of one epoch (step_batch.mini_batch_parts): drawn
        from (seed, policy version, epoch), so every epoch mixes them differently and a resumed run draws
        the same ones."""
        return mini_batch_parts(count, self.settings.mini_batches, self.settings.seed, self.version, epoch)

    def micro_batches(self, samples: dict) -> list[list[int]]:
        """Sample indices per micro-batch (step_batch.micro_batch_chunks): packed (`packing`), at most
        `micro_batch_tokens` tokens each; padded, sorted by length and cut so that none pads to more than
        that. 0: one batch, in arrival order.

        Every rank gets the same number of micro-batches: under ZeRO-3 each forward gathers parameters
        and each backward reduces gradients with the other ranks, so the passes must pair up. A rank
        with fewer splits its largest ones; one with fewer samples than passes pads with empty
        micro-batches ([]), which run a pass of zero weight."""
        chunks = micro_batch_chunks(samples, self.settings.micro_batch_tokens, self.settings.packing,
                                    self._shared_mask is not None)
        if self.world_size > 1:
            chunks = split_to_count(chunks, self._max_over_ranks(len(chunks)))
        return chunks

    def _batch_tensors(self, samples: dict, width_limit: int | None = None) -> TokenBatch:
        """The samples as a TokenBatch on this rank's device, with this role's PER_TOKEN columns and
        those of its OPTIONAL_PER_TOKEN that every sample has; packed into rows under `packing`; with shared
        prompts, units cut at `width_limit` (the step's: the one its micro-batches were planned with)."""
        batch = token_batch(samples, self.pad_id, self.PER_TOKEN, self.OPTIONAL_PER_TOKEN, self.device,
                            packed=self.settings.packing, one_row=self._one_row,
                            share_prompts=self._shared_mask is not None, budget=self.settings.micro_batch_tokens,
                            width_limit=width_limit)
        if batch.shared is not None:
            batch.shared = batch.shared.for_kernel(self._shared_mask, self.module_dtype())
        return batch

    def _micro_batch_tensors(self, samples: dict):
        """Yield (indices, batch tensors, last) for each of `micro_batches(samples)`. An empty micro-batch
        (a pass that pairs up with another rank's) gets the tensors of sample 0 and indices []: the
        caller gives it zero weight."""
        chunks = self.micro_batches(samples)
        width_limit = None
        if self._shared_mask is not None:  # units cut as micro_batches planned them, not at each micro-batch's own limit
            width_limit = step_width_limit(as_ragged(samples["prompt_token_ids"], np.int64),
                                           lengths(samples["response_token_ids"]), self.settings.micro_batch_tokens)
        for number, indices in enumerate(chunks, start=1):
            yield indices, self._batch_tensors(subset(samples, indices or [0]), width_limit), number == len(chunks)

    def _max_over_ranks(self, value: int) -> int:
        return max_over_ranks(self.torch, value, self.device)

    def _global_counts(self, parts: list[list[int]], samples: dict) -> list[tuple[float, float]]:
        """(valid tokens, responses with tokens) of each mini-batch summed over ranks: the
        normalisers of its loss, so that every optimizer step sees a global aggregate."""
        torch = self.torch
        trained = trained_token_counts(samples)  # [N]
        counts = torch.tensor([[float(trained[part].sum()), float(np.count_nonzero(trained[part]))]
                               for part in parts], dtype=torch.float64, device=self.device)  # [M, 2]
        if self.world_size > 1:
            torch.distributed.all_reduce(counts)
        return [(float(tokens), float(sequences)) for tokens, sequences in counts.tolist()]
