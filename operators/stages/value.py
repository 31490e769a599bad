"""Value operator: the critic's value of every response token, for GAE (operators.algorithms.estimators).

Use it in any Ray Data job (scoring rollouts with a trained critic) or in the RL pipeline:

    ds.map_batches(Value, fn_constructor_kwargs={"model_path": critic_folder},
                   compute=ray.data.ActorPoolStrategy(size=1), batch_format="pandas")

Input rows (prompt groups) need `prompt_token_ids` and `response_token_ids` (one list per
response, as Generate makes them). Output adds `values` (per response, one float per
response token: V of the state before that token), `critic_version` and `time_value`
(seconds of this call per row); other columns pass through.

The model is `AutoModelForTokenClassification` with one label (the policy's backbone with
a scalar head; it must share the policy's tokenizer). With a `value_store` (a PolicyStore of
critic weights, which operators.workers.value_worker.ValueWorker publishes) every weight comes from
the store, and a row that carries `policy_version` p is valued only with a critic version
>= p: the admission rule of the policy. The critic is trained in the same train step as the
policy and published right after it, so version p exists as soon as policy p does and the
wait is at most one critic step. A group of train step s is thus valued with a critic of
version in [p, s], s - p <= max_staleness: exactly s at max_staleness 0 (so a resumed run
repeats the values), and otherwise at most as stale as the policy that sampled the group,
which is the staleness the policy update already accepts. The value only sets the baseline
and the return target; PPO's value clipping keeps the critic's own update close to the
values used here.
"""

from __future__ import annotations

import time
from typing import Iterator

import pandas as pd

from operators.weights.buckets import as_weight_set


class Value:
    def __init__(self, model_path: str, value_store=None, torch_threads: int = 1,
                 trust_remote_code: bool = False, admission_timeout_s: float | None = None, packing: bool = True,
                 share_prompts: bool = False):
        """`model_path`: the critic folder (a checkpoint's critic/model export, or with a store any folder of
        the same architecture: the store's weights replace its own). `packing`: score the responses packed
        into rows (little padding; operators/algorithms/batching.py), else right-padded rows. `share_prompts`:
        each group's prompt once, before its responses (operators/algorithms/shared_prompts.py)."""
        import torch
        from transformers import AutoModelForTokenClassification

        from operators.common.devices import local_device, refuse_zero3_partitioned_build

        torch.set_num_threads(torch_threads)
        self.torch = torch
        self.device = local_device(torch, role="the Value stage")  # its GPU from Ray, else the CPU
        refuse_zero3_partitioned_build("the Value stage")  # a ZeRO-3 rank in this process would shard it
        self.model = AutoModelForTokenClassification.from_pretrained(
            model_path, num_labels=1, local_files_only=True, dtype=torch.float32, trust_remote_code=trust_remote_code,
        ).to(self.device).eval()
        self.pad_id = self.model.config.pad_token_id or 0
        from operators.algorithms.batching import check_packing

        self.one_row = check_packing(self.model, packing, "critic")  # flash-attention: one packed row
        self.packing = bool(packing)
        from operators.algorithms.shared_prompts import check_shared_prompts

        self.shared_mask = check_shared_prompts(self.model, share_prompts, packing)  # None: not shared
        self.admission_timeout_s = admission_timeout_s
        self.store = None
        self.receiver = None
        self.critic_version = 0  # the folder's weights
        if value_store is not None:
            from operators.weights.object_store import ObjectStoreReceiver

            self.store = value_store  # the critic's store (a PolicyStoreClient, passed in by the job)
            self.receiver = ObjectStoreReceiver(value_store)  # the critic's weights travel by the object store
            self.critic_version = -1  # nothing from the store yet: the folder's head is not the trained one

    def __call__(self, batch: pd.DataFrame) -> Iterator[pd.DataFrame]:
        # A generator, like Generate: rows of an older policy leave before a wait for a newer critic.
        if self.store is None or "policy_version" not in batch.columns:
            self._sync_weights(min_version=0 if self.store is not None else None)
            yield self.score(batch)
            return
        for version, part in batch.groupby("policy_version", sort=True):
            self._sync_weights(min_version=int(version))
            yield self.score(part)

    def _sync_weights(self, min_version: int | None) -> None:
        """Wait for a critic version >= min_version, then load the newest if ours is older."""
        if self.receiver is None or min_version is None:
            return
        incoming = self.receiver.newest(self.critic_version, at_least=min_version, timeout_s=self.admission_timeout_s)
        if incoming is not None:
            self.model.load_state_dict(as_weight_set(incoming.weights).state_dict(), strict=True)
            self.critic_version = incoming.version

    def _scores(self, sequences: list[list[int]]):
        """One forward over all `sequences`: the value of the state before each next token, [B, L-1] (as
        the trainer's), from packed rows or right-padded ones."""
        from operators.algorithms.batching import packed_inputs

        torch = self.torch
        if self.packing:
            packed = packed_inputs(sequences, self.pad_id, self.one_row).to(self.device)
            with torch.no_grad():
                scores = self.model(**packed.model_inputs()).logits[:, :-1, 0].float()  # [P, W-1]
            return packed.unpack(scores).cpu()  # [B, L-1]
        width = max(len(seq) for seq in sequences)
        input_ids = torch.full((len(sequences), width), self.pad_id, dtype=torch.long)  # [B, L], right-padded
        attention = torch.zeros((len(sequences), width), dtype=torch.long)  # [B, L]
        for index, seq in enumerate(sequences):
            input_ids[index, :len(seq)] = torch.tensor(seq)
            attention[index, :len(seq)] = 1
        with torch.no_grad():
            return self.model(input_ids=input_ids.to(self.device),
                              attention_mask=attention.to(self.device)).logits[:, :-1, 0].float().cpu()  # [B, L-1]

    def _shared_scores(self, prompts: list[list[int]], responses: list[list[int]]):
        """As _scores, each prompt laid out once before its responses: [B, L-1], 0 at the prompt positions
        (only the response tokens' states are read)."""
        from operators.algorithms.shared_prompts import shared_prompt_inputs

        shared = shared_prompt_inputs(prompts, responses, self.pad_id).to(self.device).for_kernel(self.shared_mask,
                                                                                                  self.model.dtype)
        with self.torch.no_grad():
            scores = shared.select(self.model(**shared.model_inputs()).logits)[..., 0].float()  # [1, N]
        return shared.scatter(scores).cpu()  # [B, L-1]

    def score(self, batch: pd.DataFrame) -> pd.DataFrame:
        """The batch with `values` from the weights loaded now; all responses in one forward."""
        start = time.perf_counter()
        batch = batch.reset_index(drop=True).copy()
        spans, sequences = [], []  # spans: (row, prompt length, response length) per response
        for row, (prompt, responses) in enumerate(zip(batch["prompt_token_ids"], batch["response_token_ids"])):
            for response in responses:
                spans.append((row, len(prompt), len(response)))
                sequences.append(list(prompt) + list(response))
        values = [[] for _ in range(len(batch))]
        if sequences:
            if self.shared_mask is not None:  # each prompt once, before its responses
                scores = self._shared_scores([seq[:p] for seq, (_, p, _) in zip(sequences, spans)],
                                             [seq[p:] for seq, (_, p, _) in zip(sequences, spans)])  # [B, L-1]
            else:
                scores = self._scores(sequences)  # [B, L-1]
            for index, (row, prompt_len, response_len) in enumerate(spans):
                # position i's value is of the state that predicts token i + 1: the same shift as the trainer's
                values[row].append(scores[index, prompt_len - 1:prompt_len - 1 + response_len].double().tolist())
        batch["values"] = pd.Series(values, index=batch.index, dtype=object)
        batch["critic_version"] = self.critic_version
        batch["time_value"] = (time.perf_counter() - start) / max(len(batch), 1)
        return batch
