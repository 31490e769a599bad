"""RefLogprob operator: log-probabilities of every response token under a frozen reference model.

The design's `ref_logprob` stage, between Reward and Advantage. KL to the reference (in the loss
with `algorithm.kl_coef`, or subtracted from the reward) needs, per response token, the
reference policy's log-prob of the token that was sampled:

    ds.map_batches(RefLogprob, fn_constructor_kwargs={"model_path": path, "temperature": 1.0},
                   compute=ray.data.ActorPoolStrategy(size=1), batch_format="pandas")

Input rows are prompt groups with `prompt_token_ids` and `response_token_ids` (one list per
response, as Generate writes them); output adds `ref_logprobs` (one list of floats per
response, aligned with its tokens). Log-probs are of softmax(logits / temperature), as the
engines and the trainer compute them, so the three agree at temperature != 1. The model is
loaded once per actor, on the GPU Ray gave the actor if any, and never trained; sequences
are scored in chunks of at most `micro_batch_tokens` tokens, packed into rows (`packing`, the
default: little padding; `share_prompts`: each group's prompt once, before its responses) or length-sorted
and padded, and within a chunk the LM head runs on at most `logits_chunk_tokens` positions at a time, as in the trainer
(operators/algorithms/logprobs.py), so the [B, L, V] logits are never held at once. All other columns pass
through.
"""

from __future__ import annotations

import time
from functools import partial

import pandas as pd

from operators.algorithms.batching import packed_inputs
from operators.algorithms.chunking import length_sorted_chunks, packed_chunks
from operators.algorithms.shared_prompts import (
    check_shared_prompts,
    shared_chunks,
    shared_prompt_inputs,
    step_width_limit,
)


class RefLogprob:
    def __init__(
        self, model_path: str, temperature: float = 1.0, micro_batch_tokens: int = 4096, torch_threads: int = 1,
        dtype: str = "float32", trust_remote_code: bool = False, logits_chunk_tokens: int = 2048,
        packing: bool = True, share_prompts: bool = False,
    ):
        import torch
        from transformers import AutoModelForCausalLM

        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        torch.set_num_threads(torch_threads)
        self.torch = torch
        from operators.common.devices import local_device, refuse_zero3_partitioned_build

        self.device = local_device(torch, role="the reference model")  # its GPU from Ray, else the CPU
        refuse_zero3_partitioned_build("the reference model")  # a ZeRO-3 rank in this process would shard it
        self.model = AutoModelForCausalLM.from_pretrained(
            model_path, local_files_only=True, trust_remote_code=trust_remote_code,
            dtype={"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype],
        ).to(self.device).eval()
        self.model.requires_grad_(False)
        self.pad_id = self.model.config.pad_token_id or 0
        self.temperature = float(temperature)
        self.micro_batch_tokens = int(micro_batch_tokens)
        self.logits_chunk_tokens = int(logits_chunk_tokens)  # 0: the full logits at once
        from operators.algorithms.batching import check_packing

        self.one_row = check_packing(self.model, packing, "reference")  # flash-attention: one packed row
        self.packing = bool(packing)
        # "bool" / "additive": a group's prompt laid out once (operators/algorithms/shared_prompts.py); None: not
        self.shared_mask = check_shared_prompts(self.model, share_prompts, packing)

    def __call__(self, batch: pd.DataFrame) -> pd.DataFrame:
        start = time.perf_counter()
        batch = batch.copy()
        sequences = [(list(prompt), list(response)) for prompt, responses in
                     zip(batch["prompt_token_ids"], batch["response_token_ids"]) for response in responses]
        scores = self.score(sequences)
        rows, index = [], 0
        for responses in batch["response_token_ids"]:
            rows.append(scores[index:index + len(responses)])
            index += len(responses)
        batch["ref_logprobs"] = rows
        batch["time_ref_logprob"] = (time.perf_counter() - start) / max(len(batch), 1)
        return batch

    def score(self, sequences: list[tuple[list[int], list[int]]]) -> list[list[float]]:
        """Per (prompt ids, response ids): the response tokens' log-probs, in order."""
        out: list[list[float] | None] = [None] * len(sequences)
        if self.shared_mask is not None:
            prompts, response_lengths = [p for p, _ in sequences], [len(r) for _, r in sequences]
            chunks = shared_chunks(prompts, response_lengths, self.micro_batch_tokens)
            width_limit = step_width_limit(prompts, response_lengths, self.micro_batch_tokens)  # as the chunks were cut
            score = partial(self._score_shared, width_limit=width_limit)
        else:
            cut = packed_chunks if self.packing else length_sorted_chunks
            chunks = cut([len(p) + len(r) for p, r in sequences], self.micro_batch_tokens)
            score = self._score_packed if self.packing else self._score_chunk
        for chunk in chunks:
            for index, values in zip(chunk, score([sequences[i] for i in chunk])):
                out[index] = values
        return out

    def _score_packed(self, sequences: list[tuple[list[int], list[int]]]) -> list[list[float]]:
        """The sequences packed into rows (operators/algorithms/batching.py: packed_inputs)."""
        from operators.algorithms.logprobs import next_token_logprobs

        packed = packed_inputs([p + r for p, r in sequences], self.pad_id, self.one_row).to(self.device)
        logprobs = next_token_logprobs(self.model, packed.input_ids, None, self.temperature, self.logits_chunk_tokens,
                                       position_ids=packed.position_ids)  # [P, W-1]
        logprobs = packed.unpack(logprobs).cpu()  # [B, L-1]: position t of row b predicts token t + 1 of sequence b
        return [logprobs[row, len(p) - 1:len(p) - 1 + len(r)].tolist() for row, (p, r) in enumerate(sequences)]

    def _score_shared(self, sequences: list[tuple[list[int], list[int]]], width_limit: int) -> list[list[float]]:
        """Each prompt laid out once before its responses (operators/algorithms/shared_prompts.py), in units cut at
        `width_limit` (the step's, as its micro-batches were planned)."""
        from operators.algorithms.logprobs import logprobs_at

        shared = shared_prompt_inputs([p for p, _ in sequences], [r for _, r in sequences], self.pad_id,
                                      self.micro_batch_tokens, width_limit)
        shared = shared.to(self.device).for_kernel(self.shared_mask, self.model.dtype)
        logprobs = logprobs_at(self.model, shared.model_inputs(), shared.select, shared.target[None], self.temperature,
                               self.logits_chunk_tokens)  # [1, N]
        logprobs = shared.scatter(logprobs).cpu()  # [B, L-1]: position t of row b predicts token t + 1 of sequence b
        return [logprobs[row, len(p) - 1:len(p) - 1 + len(r)].tolist() for row, (p, r) in enumerate(sequences)]

    def _score_chunk(self, sequences: list[tuple[list[int], list[int]]]) -> list[list[float]]:
        """The sequences right-padded to the longest."""
        from operators.algorithms.logprobs import next_token_logprobs

        torch = self.torch
        width = max(len(p) + len(r) for p, r in sequences)
        input_ids = torch.full((len(sequences), width), self.pad_id, dtype=torch.long)  # [B, L], right-padded
        attention = torch.zeros((len(sequences), width), dtype=torch.long)  # [B, L]
        for row, (prompt, response) in enumerate(sequences):
            input_ids[row, :len(prompt) + len(response)] = torch.tensor(prompt + response)
            attention[row, :len(prompt) + len(response)] = 1
        input_ids, attention = input_ids.to(self.device), attention.to(self.device)
        start = min(len(p) for p, _ in sequences) - 1  # no response token before start + 1
        logprobs = next_token_logprobs(self.model, input_ids, attention, self.temperature, self.logits_chunk_tokens,
                                       start=start).cpu()  # [B, L-1-start]
        # Position p predicts token p + 1: a response starting at len(prompt) is read from len(prompt) - 1.
        return [logprobs[row, len(p) - 1 - start:len(p) - 1 - start + len(r)].tolist()
                for row, (p, r) in enumerate(sequences)]
