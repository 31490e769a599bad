"""The tiny arithmetic model (pipelines/data/tiny.py's task), built locally and cached.

* ``build_tiny_model``: a small ``LlamaForCausalLM`` with a short, deterministic,
  supervised warm-up (correct targets, then *noisy* targets for the output head only),
  so that RL starts from a policy that knows the format (digits then ``<eos>``) and
  has a low but non-zero success rate (~0.15 sampling at temperature 1).  The result
  is cached in a folder named by a hash of all build parameters
  (pipelines/data/model_cache.py).
* ``warm_up_and_save``: the warm-up and the save, on the arithmetic task's batches or on
  another task's (pipelines/data/tiny_tools.py).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pipelines.data.model_cache import build_cached, built_folder
from pipelines.data.tiny import CHARS, DEFAULT_MODEL_CONFIG, SPECIAL_TOKENS, build_char_tokenizer

# Bump when the build recipe changes in a way the parameters do not capture.
BUILD_VERSION = 1

# Warm-up recipe (deterministic for a seed):
# phase 1, ``warmup_clean_steps``: all weights, correct targets -> the body learns
#   the sum and the format (digits, then ``<eos>``);
# phase 2, ``warmup_steps``: only ``lm_head`` (``warmup_noisy_params="head"``), on
#   noisy targets: the sum with probability ``warmup_correct_prob``, otherwise a wrong
#   answer (uniform over 0..2*max_operand, or with ``warmup_near_prob`` off by
#   1..``warmup_near_radius``), as exact soft token targets.  The head becomes
#   under-confident (low but non-zero success when sampling at temperature 1) while
#   the body keeps what it knows, so RL can sharpen it quickly.  Training the whole
#   model on noisy targets instead (``"all"``) erases the knowledge of the sum, and
#   RL then has to relearn addition: far slower.
DEFAULT_WARMUP: dict[str, Any] = dict(
    max_operand=9,
    warmup_clean_steps=200,
    warmup_steps=100,
    warmup_batch_size=128,
    warmup_lr=3e-3,
    warmup_correct_prob=0.15,
    warmup_near_prob=0.0,  # share of wrong answers off by 1..warmup_near_radius
    warmup_near_radius=3,
    warmup_noisy_lr=1e-2,  # learning rate of phase 2 (None: warmup_lr)
    warmup_noisy_params="head",  # phase 2 trains "head" (lm_head only) or "all"
)


def split_overrides(overrides: dict[str, Any], warmup_defaults: dict[str, Any],
                    builder: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(model config, warm-up) of a tiny model's build: the defaults with `overrides` applied, each
    either a warm-up knob or a LlamaConfig field; anything else is a TypeError naming `builder`."""
    model_cfg = dict(DEFAULT_MODEL_CONFIG)
    warmup = dict(warmup_defaults)
    for key, value in overrides.items():
        if key in warmup:
            warmup[key] = value
        elif key.startswith("warmup_") or not _is_llama_config_field(key):
            raise TypeError(f"unknown {builder} parameter {key!r}")
        else:
            model_cfg[key] = value
    return model_cfg, warmup


def _build_params(seed: int, overrides: dict[str, Any]) -> dict[str, Any]:
    model_cfg, warmup = split_overrides(overrides, DEFAULT_WARMUP, "build_tiny_model")
    return {
        "build_version": BUILD_VERSION,
        "seed": seed,
        "vocab": SPECIAL_TOKENS + CHARS,
        "model": model_cfg,
        "warmup": warmup,
    }


def _is_llama_config_field(key: str) -> bool:
    from transformers import LlamaConfig

    return hasattr(LlamaConfig(), key)


def _answer_distribution(c: int, w: dict[str, Any], correct_prob: float) -> dict[str, float]:
    """Target distribution over answer strings for a problem whose sum is ``c``:
    the sum with probability ``correct_prob``; otherwise a wrong answer, near the sum
    (off by 1..``warmup_near_radius``) with probability ``warmup_near_prob``, else
    uniform over 0..2*max_operand."""
    m, r = w["max_operand"], w["warmup_near_radius"]
    q: dict[str, float] = {str(c): correct_prob}
    wrong = 1.0 - correct_prob
    near = [c + k for k in range(-r, r + 1) if k != 0 and c + k >= 0]
    far = [x for x in range(2 * m + 1) if x != c]
    for group, share in ((near, w["warmup_near_prob"]), (far, 1.0 - w["warmup_near_prob"])):
        for x in group:
            q[str(x)] = q.get(str(x), 0.0) + wrong * share / len(group)
    return {k: v for k, v in q.items() if v > 0}


def _next_char_distribution(q: dict[str, float], prefix: str) -> dict[str, float]:
    """Distribution of the next character (``None`` = eos) given an answer prefix."""
    out: dict[str | None, float] = {}
    for ans, p in q.items():
        if ans == prefix:
            out[None] = out.get(None, 0.0) + p
        elif ans.startswith(prefix):
            ch = ans[len(prefix)]
            out[ch] = out.get(ch, 0.0) + p
    total = sum(out.values())
    return {k: v / total for k, v in out.items()}


class _WarmupData:
    """Batches of ``<bos>a+b=t<eos>`` with ``t`` drawn from ``_answer_distribution``
    and, for each answer position, the exact (soft) target distribution of that token
    given the prefix.  Soft targets give the expected gradient of training on noisy
    answers without its sampling noise, so the model keeps the knowledge of the sum
    while its answer distribution spreads out."""

    def __init__(self, tokenizer, w: dict[str, Any], gen: torch.Generator):
        self.w, self.gen = w, gen
        self.vocab = tokenizer.get_vocab()
        self.bos, self.eos, self.pad = tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id
        self.V = len(tokenizer)
        self._answers: dict[tuple[int, float], tuple[list[str], list[float]]] = {}
        self._next: dict[tuple[int, float, str], torch.Tensor] = {}

    def answers(self, c: int, p: float) -> tuple[list[str], list[float]]:
        key = (c, p)
        if key not in self._answers:
            q = _answer_distribution(c, self.w, p)
            self._answers[key] = (list(q), list(np.cumsum(list(q.values()))))
        return self._answers[key]

    def next_token(self, c: int, p: float, prefix: str) -> torch.Tensor:
        key = (c, p, prefix)
        if key not in self._next:
            q = _answer_distribution(c, self.w, p)
            vec = torch.zeros(self.V)
            for ch, prob in _next_char_distribution(q, prefix).items():
                vec[self.eos if ch is None else self.vocab[ch]] = prob
            self._next[key] = vec
        return self._next[key]

    def batch(self, correct_prob: float) -> tuple[torch.Tensor, ...]:
        m, bs, gen = self.w["max_operand"], self.w["warmup_batch_size"], self.gen
        a = torch.randint(0, m + 1, (bs,), generator=gen).tolist()
        b = torch.randint(0, m + 1, (bs,), generator=gen).tolist()
        u = torch.rand(bs, generator=gen).tolist()
        rows, answers = [], []
        for x, y, ui in zip(a, b, u):
            names, cdf = self.answers(x + y, correct_prob)
            t = names[min(int(np.searchsorted(cdf, ui, side="right")), len(names) - 1)]
            prompt = [self.bos] + [self.vocab[ch] for ch in f"{x}+{y}="]
            rows.append((prompt, [self.vocab[ch] for ch in t] + [self.eos]))
            answers.append((x + y, t))
        width = max(len(p) + len(r) for p, r in rows)
        ids = torch.full((bs, width), self.pad, dtype=torch.long)
        mask = torch.zeros((bs, width), dtype=torch.long)
        target = torch.zeros((bs, width, self.V))
        weight = torch.zeros((bs, width))
        for i, ((prompt, resp), (c, t)) in enumerate(zip(rows, answers)):
            # right padding for training (positions stay 0..n-1, no position_ids needed)
            n = len(prompt) + len(resp)
            ids[i, :n] = torch.tensor(prompt + resp)
            mask[i, :n] = 1
            # the logit at position j predicts token j + 1: answer chars and eos
            for k in range(len(resp)):
                target[i, len(prompt) - 1 + k] = self.next_token(c, correct_prob, t[:k])
                weight[i, len(prompt) - 1 + k] = 1.0
        return ids, mask, target, weight


def _soft_loss(model, ids, mask, target, weight) -> torch.Tensor:
    logits = model(input_ids=ids, attention_mask=mask).logits
    logp = torch.log_softmax(logits.float(), dim=-1)
    per_pos = -(target * logp).sum(-1)
    return (per_pos * weight).sum() / weight.sum()


def warm_up_and_save(path: Path, params: dict[str, Any], tokenizer, batches=None) -> dict[str, Any]:
    """The warm-up (phase "clean", then "noisy"; see DEFAULT_WARMUP) and the save. `batches(phase)`: the
    next batch (ids, mask, soft targets, weights) of a phase; default: the arithmetic task's. The tiny
    tool task (pipelines/data/tiny_tools.py) passes its own."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    w = params["warmup"]
    torch.manual_seed(params["seed"])
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        dtype="float32",
        **params["model"],
    )
    head_dim = config.hidden_size // config.num_attention_heads
    if head_dim < 32:
        raise ValueError(f"head_dim {head_dim} < 32 (vLLM's CPU attention kernel needs >= 32)")
    config._attn_implementation = "eager"  # fastest for these tiny shapes on CPU
    model = LlamaForCausalLM(config).to(torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=w["warmup_lr"], weight_decay=0.0)
    clean, noisy = int(w["warmup_clean_steps"]), int(w["warmup_steps"])
    ramp = max(1, (clean + noisy) // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / ramp))
    if batches is None:
        data = _WarmupData(tokenizer, w, torch.Generator().manual_seed(params["seed"]))

        def batches(phase: str):
            return data.batch(1.0 if phase == "clean" else float(w["warmup_correct_prob"]))
    t0 = time.perf_counter()
    losses = {"clean": float("nan"), "noisy": float("nan")}
    for step in range(clean + noisy):
        phase = "clean" if step < clean else "noisy"
        if step == clean:
            if w["warmup_noisy_lr"] is not None:
                sched.base_lrs = [float(w["warmup_noisy_lr"])] * len(sched.base_lrs)
            if w["warmup_noisy_params"] == "head":
                # keep the body's knowledge (of the sum; of copying, for the tool task); recalibrate the head
                for name, prm in model.named_parameters():
                    prm.requires_grad_(name.startswith("lm_head"))
            elif w["warmup_noisy_params"] != "all":
                raise ValueError("warmup_noisy_params must be 'head' or 'all'")
        loss = _soft_loss(model, *batches(phase))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses[phase] = loss.item()
    for prm in model.parameters():
        prm.requires_grad_(True)
    model.eval()
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        do_sample=True,
        temperature=1.0,
    )
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return {
        "warmup_seconds": time.perf_counter() - t0,
        "final_clean_loss": losses["clean"],
        "final_noisy_loss": losses["noisy"],
    }


def build_tiny_model(cache_dir: str | Path | None = None, seed: int = 0, **overrides) -> Path:
    """Build (or reuse) the warmed-up tiny Llama and return its folder.

    ``overrides`` are warm-up knobs (see ``DEFAULT_WARMUP``: ``max_operand``,
    ``warmup_clean_steps``, ``warmup_steps``, ``warmup_batch_size``, ``warmup_lr``,
    ``warmup_correct_prob``, ``warmup_near_prob``, ``warmup_near_radius``,
    ``warmup_noisy_lr``, ``warmup_noisy_params``) or ``LlamaConfig`` fields (see
    ``DEFAULT_MODEL_CONFIG``: ``hidden_size``, ``num_hidden_layers``, ...); anything
    else raises ``TypeError``.  All of them, with ``seed``, go
    into the folder name's hash.  The folder is built in a temporary sibling and
    renamed into place with the marker file written last, so a crash never leaves
    a half-built folder under the final name.
    """
    params = _build_params(seed, overrides)
    return build_cached(cache_dir, "tiny-llama-arith", params, build_char_tokenizer, warm_up_and_save, threads=2)


def cached_tiny_model() -> str | None:
    """The default tiny model's folder (builtin:tiny-arith) when it is built, else None: nothing is built."""
    return built_folder(None, "tiny-llama-arith", _build_params(0, {}))
