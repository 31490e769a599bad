"""One DeepSpeed rank of the critic group: the value model of PPO with GAE, run as a Ray actor.

The critic is the policy's backbone with a scalar head (`AutoModelForTokenClassification`,
num_labels=1, loaded from the critic folder, which initialises the head). It is a
`TrainWorker` with another model and loss: the DeepSpeed set-up, mini/micro-batching,
publishing, checkpoints and RNG states are the policy rank's, so both read the same.

Each train step fits the values of the policy's tokens to their GAE return targets with PPO's
clipped value loss (operators.algorithms.losses.clipped_value_loss), token-mean over the step's trained
tokens on all ranks (the policy's normaliser; a multi-turn episode's observation tokens carry
no loss, as in the policy's), in `ppo_epochs x mini_batches` optimizer steps drawn like the
policy's. Rank 0 then publishes the critic to its own store as version v + 1, matching the
policy version.

The clip is centred on the current critic's values, as verl's and AReaL's V_old: the Value stage's
values where the critic version that made them is still this one, else (generation ran ahead of
training, max_staleness > 0) this critic's own values before the step's first update.
"""

from __future__ import annotations

import time

import numpy as np

from operators.algorithms.batching import TokenBatch, trained_token_counts
from operators.algorithms.columns import Ragged
from operators.algorithms.loss_composition import StatSums
from operators.workers.settings import TrainerSettings
from operators.workers.train_worker import TrainWorker


class ValueWorker(TrainWorker):
    ROLE, SECTION = "critic", "critic"
    PER_TOKEN, OPTIONAL_PER_TOKEN = ("returns", "old_values"), ()

    def __init__(self, rank: int, world_size: int, master_port: int, settings: TrainerSettings,
                 value_store, value_clip: float = 0.2):
        """`value_store`: the critic's store (a PolicyStore created with initial_version=-1). The head
        is initialised here, not in the folder, so rank 0 publishes it as version 0: the Value stage
        takes every critic version, the first included, from the store."""
        self.value_clip = value_clip
        super().__init__(rank, world_size, master_port, settings, value_store)
        self._publish()  # version 0; nothing on a rank that does not join a publish

    def _build_model(self, settings: TrainerSettings):
        from transformers import AutoConfig, AutoModelForTokenClassification

        config = AutoConfig.from_pretrained(settings.model_path, num_labels=1, local_files_only=True,
                                            trust_remote_code=settings.trust_remote_code)
        # No dropout before the head (HF's default is 0.1): the values trained here must be the values the
        # Value stage (eval mode) computes with the same weights.
        config.classifier_dropout = 0.0
        return AutoModelForTokenClassification.from_pretrained(
            settings.model_path, config=config, local_files_only=True, dtype=self.module_dtype(),
            trust_remote_code=settings.trust_remote_code,
        )

    def values(self, batch: TokenBatch):
        """V of the state before each next token, in shifted coordinates [B, L-1] (as the mask); a packed
        batch's values are unpacked per sequence (shared prompts: read at each response token's state)."""
        return batch.unpack(batch.outputs(self.engine(**batch.model_inputs()).logits)[..., 0].float())

    def _value_loss(self, part: dict, global_tokens: float, stats: StatSums):
        """Yield (loss, last) per micro-batch: the clipped value loss summed over its tokens, divided by this
        rank's share of the global token count, so DeepSpeed's average over ranks is the token mean."""
        from operators.algorithms.losses import VALUE_LOSSES

        loss_fn = VALUE_LOSSES.get("clipped")
        for indices, batch, last in self._micro_batch_tensors(part):  # [] pairs up with other ranks' passes
            mask = batch.mask  # [B, L-1]
            values = self.values(batch)  # [B, L-1]
            old_values, returns = batch.require("old_values", "returns")  # [B, L-1] each
            per_token, loss_stats = loss_fn(values, old_values, returns, mask,
                                            value_clip=self.value_clip)  # [B, L-1]
            tokens = float(mask.sum().item())
            loss = per_token.sum() / max(global_tokens / self.world_size, 1.0)
            if indices:
                loss_stats["value_loss"] = float(per_token.detach().sum()) / max(tokens, 1.0)
                stats.add(loss_stats, tokens)
            yield (loss if indices else loss * 0.0), last

    def _current_old_values(self, samples: dict) -> tuple[dict, int]:
        """The samples with `old_values` from this critic where the Value stage's came from an older critic
        version (`critic_version` per sample), and how many it replaced. A collective under several ranks:
        every rank runs the forwards when any rank has a stale sample (their passes must pair up)."""
        versions = samples.get("critic_version")
        stale = {i for i, version in enumerate(versions if versions is not None else [])
                 if version is not None and 0 <= version != self.version}
        anyone = self._max_over_ranks(int(bool(stale))) if self.world_size > 1 else int(bool(stale))
        if not anyone:
            return samples, 0
        old_values = list(samples["old_values"])
        with self.torch.no_grad():
            for indices, batch, _ in self._micro_batch_tensors(samples):
                values = self.values(batch)  # [B, L-1]
                for row, index in enumerate(indices):
                    if index in stale:
                        old_values[index] = batch.at_response(values, row).cpu().numpy().astype(np.float64)
        return {**samples, "old_values": Ragged.from_rows(old_values, np.float64)}, len(stale)

    def train_step(self, samples: dict, global_tokens: int, global_sequences: int) -> dict:
        """One critic step on this rank's shard (`prompt_token_ids`, `response_token_ids`, and per response
        token `returns` and `old_values`); rank 0 then publishes version + 1."""
        start = time.perf_counter()
        self.engine.train()
        count = len(samples["response_token_ids"])
        if not count:
            raise ValueError("train_step got no samples")
        stats = StatSums()
        samples, refreshed = self._current_old_values(samples)

        def loss_of(part: dict, tokens: float, sequences: float, epoch: int, valid: float):
            return self._value_loss(part, tokens, stats)

        # the policy's mini-batch draw (same seed and version), the policy's update schedule
        _, grad_norms, skipped, _, empty = self._updates(
            samples, count, global_tokens, global_sequences, loss_of,
            lambda value: f"the value loss of critic version {self.version + 1} is {value} on rank {self.rank} "
                          "(train.nan_policy: stop); lower critic.lr or check the rewards",
        )
        self.version += 1
        publish_seconds = self._publish()  # 0.0 on a rank that does not join a publish
        return {
            "nonfinite_skipped": int(skipped),
            "grad_norm": grad_norms[0] if grad_norms else float("nan"),
            "empty_updates": empty,
            "stale_values_refreshed": refreshed,  # samples whose V_old this critic recomputed
            "num_tokens": int(trained_token_counts(samples).sum()),
            "train_seconds": time.perf_counter() - start - publish_seconds,
            "publish_seconds": publish_seconds,
            **stats.means(),
        }
