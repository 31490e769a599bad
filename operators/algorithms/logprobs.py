"""Log-probs of a causal LM's next tokens without its [B, L, V] logits: the model gives its final hidden
states and the LM head is applied a chunk of positions at a time
(operators.algorithms.losses.chunked_token_logprobs), so only one chunk's [B, C, V] logits exist at once.

Shared by the trainer's ranks (operators/workers/train_worker.py, with a graph, under ZeRO), the reference
model (operators/stages/ref_logprob.py) and the HF engine (operators/engines/hf.py), which score without one.
"""

from __future__ import annotations

import functools
import inspect

from operators.algorithms.losses import chunked_token_logprobs, token_logprobs


def chunkable_head(model):
    """The LM head when log-probs can be computed from the final hidden states chunk by chunk, else None
    (then the caller takes the model's full logits): the head must be a plain linear layer, the model must
    accept `logits_to_keep`, and its logits must be the plain head of the last hidden state (no
    soft-capping or logit scale)."""
    import torch

    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    config = model.config
    plain = not any(getattr(config, key, None) for key in ("final_logit_softcapping", "logit_scale"))
    takes_keep = "logits_to_keep" in inspect.signature(model.forward).parameters
    return head if isinstance(head, torch.nn.Linear) and plain and takes_keep else None


def head_projection(head):
    """hidden [..., H] -> logits [..., V] through the head's weight as it is now (under ZeRO-3 the caller
    holds it gathered until the backward is done: operators/workers/engine_steps.py, gathered_head).

    The weight enters the graph once (one view of the parameter, used by every chunk and every recompute
    of a chunk in backward), so autograd sums the chunks' gradients before they reach the parameter, and
    ZeRO's per-parameter gradient hook (the reduce to the shards) fires once per backward, with the whole
    gradient, as it does for a module called once."""
    import torch

    weight = head.weight.view_as(head.weight)  # [V, H]
    bias = None if head.bias is None else head.bias.view_as(head.bias)  # [V]
    return functools.partial(torch.nn.functional.linear, weight=weight, bias=bias)


def chunked_logprobs(hidden, head, targets, temperature: float, chunk_tokens: int, entropy_grad: bool = False,
                     with_entropy: bool = True):
    """Log-probs [B, T] of `targets` [B, T] and the entropy [B, T] of each position's distribution (None
    without `with_entropy`), from the final hidden states [B, T, H] through `head` (head_projection), at
    most `chunk_tokens` positions (rows x positions) at a time."""
    positions = max(1, chunk_tokens // max(1, hidden.shape[0]))
    return chunked_token_logprobs(hidden, head_projection(head), targets, temperature, positions, entropy_grad,
                                  with_entropy)


def next_token_logprobs(model, input_ids, attention, temperature: float, chunk_tokens: int, position_ids=None,
                        start: int = 0):
    """Without a graph: log-probs [B, L-1-start] of the tokens of `input_ids` [B, L] from position start + 1 on
    (the ones before are context only) under `model` (a Hugging Face causal LM), of softmax(logits /
    temperature). `attention` None with restarting `position_ids`: sequences packed in one row
    (operators.algorithms.batching.PackedInputs). With `chunk_tokens` (> 0) and a plain head (chunkable_head), the backbone's last hidden
    state [B, L, H] is all the model returns and the head runs on at most `chunk_tokens` positions (rows x
    positions) at a time; otherwise (or when the batch is no larger than a chunk) the full logits are taken."""
    inputs = {"input_ids": input_ids, "attention_mask": attention}
    if position_ids is not None:
        inputs["position_ids"] = position_ids
    if attention is None:  # packed sequences (operators/algorithms/batching.py): read from the position ids, no cache
        inputs["use_cache"] = False
    return logprobs_at(model, inputs, lambda values: values[:, start:-1], input_ids[:, start + 1:], temperature,
                       chunk_tokens)


def logprobs_at(model, inputs: dict, select, targets, temperature: float, chunk_tokens: int):
    """Without a graph: log-probs [rows, T] of `targets` [rows, T], each read at the output position `select`
    picks from the model's per-position outputs on `inputs` ([rows', W, ...] -> [rows, T, ...]; e.g. each
    position but the last, or shared_prompts.SharedPromptInputs.select). The head runs in chunks as
    next_token_logprobs says."""
    import torch

    head = chunkable_head(model) if chunk_tokens and targets.numel() > chunk_tokens else None
    backbone = getattr(model, "base_model", model)
    with torch.no_grad():
        if head is None or backbone is model:
            logits = select(model(**inputs).logits).float() / temperature  # [rows, T, V]
            return token_logprobs(logits, targets)
        hidden = select(backbone(**inputs).last_hidden_state)  # [rows, T, H], the state the head reads
        return chunked_logprobs(hidden, head, targets, temperature, chunk_tokens, with_entropy=False)[0]
