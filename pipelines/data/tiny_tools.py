"""Tiny tool-using task for streamrl: two-digit addition with a calculator, built locally.

A correct episode is ``<bos>47+38=[47+38]{85}85<eos>``: the model's first turn is the tool call
``[47+38]`` (the turn stops at ``]``), the environment appends the calculator's result ``{85}``,
and the model's second turn copies it, ``85<eos>``.  Answering directly (``<bos>47+38=91<eos>``)
is allowed and almost always wrong: the tiny model cannot add two-digit numbers.

* ``build_tool_tokenizer``: ``pipelines.data.tiny``'s character tokenizer plus ``[]{}``.
* ``make_tool_dataset``: deterministic ``"a+b="`` -> ``"c"`` prompts (10 <= a, b <= 99),
  "all" / "train" / "heldout" splits.
* ``calculator``, ``tool_observation``: the tool, and the observation a turn gets back.
* ``tool_answer_exact``: the reward (1.0 / 0.0) of a whole transcript.
* ``build_tiny_tool_model``: the tiny Llama of ``pipelines.data.tiny`` warmed up so that it copies
  calls and results well but calls the tool only ~20% of the time (success ~0.2 sampling at
  temperature 1): RL only has to learn to call the tool.  Cached by a hash of its parameters.
* ``tool_success_rate``: the multi-turn protocol with HF ``generate``, as a reference.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from operators.environments.environment import MAX_EXPRESSION_CHARS, MAX_MAGNITUDE, calculator  # noqa: F401 - the task's tool
from operators.stages.reward import tool_answer_exact  # noqa: F401 - the task's reward
from pipelines.data.model_cache import build_cached, built_folder
from pipelines.data.tiny import CHARS, SPECIAL_TOKENS, build_char_tokenizer, choose_split, load_model, problem_table
from pipelines.data.tiny_build import split_overrides, warm_up_and_save

CALL_OPEN, CALL_CLOSE, OBS_OPEN, OBS_CLOSE = "[", "]", "{", "}"
# Appended after tiny.CHARS: the ids of the arithmetic characters stay those of pipelines.data.tiny.
TOOL_CHARS = CHARS + [CALL_OPEN, CALL_CLOSE, OBS_OPEN, OBS_CLOSE]
TOOL_ERROR = "error"  # the observation of a call the calculator rejects: "{error}"

MIN_OPERAND, MAX_OPERAND = 10, 99
# The held-out split's own seed (see pipelines.data.tiny.HELDOUT_SEED): it never moves with data.seed.
TOOLS_HELDOUT_SEED = 20261207

# Bump when the build recipe changes in a way the parameters do not capture.
TOOLS_BUILD_VERSION = 1

# Warm-up recipe (deterministic for a seed):
# phase 1, ``warmup_clean_steps``: all weights, clean tool transcripts; the loss is on the
#   model's tokens only (the call ``[a+b]``, the final answer and ``<eos>``), never on the
#   prompt or the observation ``{c}`` -> the body learns to copy operands and the result.
#   A share ``warmup_clean_direct_rows`` are direct answers ``a+b=g<eos>`` instead (the first
#   decision's target is still ``[``; only the guess's digits and ``<eos>`` are trained, soft,
#   as below): without them the body has no features of its own for "a guess after ``=``",
#   its copying features serve there too, and phase 2 then breaks the copying (measured:
#   tool_success 0.14 with 0.0, ~0.99 with 0.3);
# phase 2, ``warmup_steps``: only ``lm_head`` (``warmup_noisy_params="head"``), soft targets:
#   right after ``=`` the target puts ``warmup_tool_prob`` on ``[`` and the rest on a direct
#   answer, uniform over the possible sums 20..198 (so it is right ~1/179 of the time); the
#   continuations of both paths get their exact next-token targets (one-hot on the tool path).
#   A share ``warmup_tool_rows`` of the rows follow the tool path, so the head keeps it sharp
#   while the first decision becomes ~``warmup_tool_prob``: sampling at temperature 1 succeeds
#   ~0.2 of the time; greedy decoding answers directly (``[`` is not the most likely token) and
#   fails until RL makes calling the tool the mode.
DEFAULT_TOOL_WARMUP: dict[str, Any] = dict(
    warmup_clean_steps=300,
    warmup_steps=100,
    warmup_batch_size=128,
    warmup_lr=3e-3,
    warmup_tool_prob=0.2,
    warmup_tool_rows=0.5,
    warmup_clean_direct_rows=0.3,
    warmup_noisy_lr=1e-2,  # learning rate of phase 2 (None: warmup_lr)
    warmup_noisy_params="head",  # phase 2 trains "head" (lm_head only) or "all"
)


# --------------------------------------------------------------------------- tokenizer


def build_tool_tokenizer():
    """``pipelines.data.tiny.build_char_tokenizer`` with ``[]{}`` appended to its characters."""
    return build_char_tokenizer(TOOL_CHARS)


# ----------------------------------------------------------------------------- dataset


def _tool_problems() -> list[tuple[str, str]]:
    span = range(MIN_OPERAND, MAX_OPERAND + 1)
    return [(f"{a}+{b}=", str(a + b)) for a in span for b in span]


def split_tool_problems(split: str) -> list[tuple[str, str]]:
    """The problems of one split: "all", "train" (never held out) or "heldout" (disjoint from
    "train", ``HELDOUT_FRACTION`` of the 8100 problems).  The warm-up saw every problem."""
    return choose_split(_tool_problems(), split, TOOLS_HELDOUT_SEED)


def make_tool_dataset(num_prompts: int, seed: int = 0, split: str = "all") -> pd.DataFrame:
    """``num_prompts`` problems ``"a+b="`` (10 <= a, b <= 99) from ``split``, answer ``str(a + b)``.

    Deterministic for ``seed``; distinct problems while there are enough, then drawn with
    replacement, except from "heldout", which never repeats one (at most its size is returned).
    ``prompt_id`` is the row position, e.g. ``"tools-00017"`` (``"tools-heldout-00003"``).
    """
    return problem_table(split_tool_problems(split), num_prompts, seed, split, "tools")


# ------------------------------------------------------------------------- tool, reward

# The calculator is the builtin tool of operators/environments/environment.py and the reward a builtin of operators/stages/reward.py;
# they are imported here so that this module names the task's whole protocol.


def tool_observation(turn: str) -> str | None:
    """What the environment appends after a model turn: ``"{<result>}"`` when the turn ends with
    ``]`` (the call is the text after its last ``[``), ``"{error}"`` when the calculator rejects
    it (or the turn has no ``[``); ``None`` when the turn did not call the tool."""
    if not turn.endswith(CALL_CLOSE):
        return None
    start = turn.rfind(CALL_OPEN)
    if start < 0:
        return OBS_OPEN + TOOL_ERROR + OBS_CLOSE
    try:
        result = calculator(turn[start + 1 : -1])
    except ValueError:
        result = TOOL_ERROR
    return OBS_OPEN + result + OBS_CLOSE


# ------------------------------------------------------------------------------- model


def _build_params(seed: int, overrides: dict[str, Any]) -> dict[str, Any]:
    model_cfg, warmup = split_overrides(overrides, DEFAULT_TOOL_WARMUP, "build_tiny_tool_model")
    return {
        "task": "tools",
        "build_version": TOOLS_BUILD_VERSION,
        "seed": seed,
        "vocab": SPECIAL_TOKENS + TOOL_CHARS,
        "operands": [MIN_OPERAND, MAX_OPERAND],
        "model": model_cfg,
        "warmup": warmup,
    }


# every sum a direct answer may guess
_DIRECT_ANSWERS = [str(c) for c in range(2 * MIN_OPERAND, 2 * MAX_OPERAND + 1)]


def _direct_next_char(prefix: str) -> dict[str | None, float]:
    """Next character (``None`` = eos) of a direct answer drawn uniformly from ``_DIRECT_ANSWERS``,
    given the part written so far."""
    out: dict[str | None, float] = {}
    for ans in _DIRECT_ANSWERS:
        if ans == prefix:
            out[None] = out.get(None, 0.0) + 1.0
        elif ans.startswith(prefix):
            out[ans[len(prefix)]] = out.get(ans[len(prefix)], 0.0) + 1.0
    total = sum(out.values())
    return {k: v / total for k, v in out.items()}


class _ToolWarmupData:
    """Batches of tool transcripts ``<bos>a+b=[a+b]{c}c<eos>`` and direct answers
    ``<bos>a+b=g<eos>``, with a soft target distribution per trained position.  Targets are rows
    of a small table (one-hot rows for every token, plus the few soft rows), so a batch is an
    index matrix; the prompt and the observation get weight 0."""

    def __init__(self, tokenizer, w: dict[str, Any], gen: torch.Generator):
        self.w, self.gen = w, gen
        self.vocab = tokenizer.get_vocab()
        self.bos, self.eos, self.pad = tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id
        self.V = len(tokenizer)
        self.rows: list[torch.Tensor] = [torch.eye(self.V)[i] for i in range(self.V)]  # one-hot rows
        self._soft: dict[tuple, int] = {}

    def _row(self, key: tuple, dist: dict[str | None, float]) -> int:
        if key not in self._soft:
            vec = torch.zeros(self.V)
            for ch, p in dist.items():
                vec[self.eos if ch is None else self.vocab[ch]] += p
            self._soft[key] = len(self.rows)
            self.rows.append(vec)
        return self._soft[key]

    def first(self, tool_prob: float) -> int:
        """Target row of the first decision, right after ``=``: ``[`` or a direct answer."""
        dist: dict[str | None, float] = {CALL_OPEN: tool_prob}
        for ch, p in _direct_next_char("").items():
            dist[ch] = dist.get(ch, 0.0) + (1.0 - tool_prob) * p
        return self._row(("first", tool_prob), dist)

    def ids(self, text: str) -> list[int]:
        return [self.vocab[ch] for ch in text]

    def batch(self, noisy: bool) -> tuple[torch.Tensor, ...]:
        w, bs, gen = self.w, int(self.w["warmup_batch_size"]), self.gen
        span = MAX_OPERAND - MIN_OPERAND + 1
        a = (torch.randint(0, span, (bs,), generator=gen) + MIN_OPERAND).tolist()
        b = (torch.randint(0, span, (bs,), generator=gen) + MIN_OPERAND).tolist()
        share = float(w["warmup_tool_rows"]) if noisy else 1.0 - float(w["warmup_clean_direct_rows"])
        tool_row = (torch.rand(bs, generator=gen) < share).tolist()
        guess = torch.randint(0, len(_DIRECT_ANSWERS), (bs,), generator=gen).tolist()
        tool_prob = float(w["warmup_tool_prob"]) if noisy else 1.0
        first = self.first(tool_prob)
        seqs, tids, wts = [], [], []
        for x, y, use_tool, g in zip(a, b, tool_row, guess):
            prompt = [self.bos] + self.ids(f"{x}+{y}=")
            direct = not use_tool
            # (tokens, trained?) segments after the prompt
            if direct:
                t = _DIRECT_ANSWERS[g]
                segs = [(self.ids(t) + [self.eos], True)]
            else:
                c = str(x + y)
                segs = [
                    (self.ids(f"[{x}+{y}]"), True),
                    (self.ids(OBS_OPEN + c + OBS_CLOSE), False),  # the environment's tokens
                    (self.ids(c) + [self.eos], True),
                ]
            # per token: its target row (its own one-hot unless soft) and weight
            seq, tid, wt = list(prompt), [0] * len(prompt), [0.0] * len(prompt)
            for toks, trained in segs:
                seq += toks
                tid += toks
                wt += [1.0 if trained else 0.0] * len(toks)
            tid[len(prompt)] = first  # the decision right after "="
            if direct:
                for k in range(1, len(t) + 1):
                    tid[len(prompt) + k] = self._row(("direct", t[:k]), _direct_next_char(t[:k]))
            # the logit at position j predicts token j + 1
            seqs.append(seq)
            tids.append(tid[1:] + [0])
            wts.append(wt[1:] + [0.0])
        width = max(len(s) for s in seqs)
        ids = torch.full((bs, width), self.pad, dtype=torch.long)
        mask = torch.zeros((bs, width), dtype=torch.long)
        tid_t = torch.zeros((bs, width), dtype=torch.long)
        weight = torch.zeros((bs, width))
        for i, (s, t, wt) in enumerate(zip(seqs, tids, wts)):
            n = len(s)  # right padding for training (positions stay 0..n-1)
            ids[i, :n] = torch.tensor(s)
            mask[i, :n] = 1
            tid_t[i, :n] = torch.tensor(t)
            weight[i, :n] = torch.tensor(wt)
        target = torch.stack(self.rows)[tid_t]
        return ids, mask, target, weight


def _build(path: Path, params: dict[str, Any], tokenizer) -> dict[str, Any]:
    """pipelines.data.tiny_build's warm-up and save, on the tool task's batches."""
    data = _ToolWarmupData(tokenizer, params["warmup"], torch.Generator().manual_seed(params["seed"]))
    return warm_up_and_save(path, params, tokenizer, batches=lambda phase: data.batch(noisy=phase == "noisy"))


def build_tiny_tool_model(cache_dir: str | Path | None = None, seed: int = 0, **overrides) -> Path:
    """Build (or reuse) the warmed-up tiny tool-using Llama and return its folder.

    ``overrides`` are warm-up knobs (``DEFAULT_TOOL_WARMUP``) or ``LlamaConfig`` fields
    (``pipelines.data.tiny.DEFAULT_MODEL_CONFIG``); anything else raises ``TypeError``.  All of them,
    with ``seed``, name the folder (``tiny-llama-tools-<hash>``).  Built in a temporary sibling
    and renamed into place with the marker file written last, so a crash never leaves a
    half-built folder under the final name; one thread and fixed seeds make it deterministic.
    """
    return build_cached(cache_dir, "tiny-llama-tools", _build_params(seed, overrides), build_tool_tokenizer, _build,
                        threads=1)


def cached_tiny_tool_model() -> str | None:
    """The default tool model's folder (builtin:tiny-tools) when it is built, else None: nothing is built."""
    return built_folder(None, "tiny-llama-tools", _build_params(0, {}))


# ---------------------------------------------------------------------------- evaluate


@torch.no_grad()
def tool_episodes(
    model,
    tokenizer,
    prompts: list[str],
    samples: int = 8,
    seed: int = 0,
    temperature: float = 1.0,
    max_turns: int = 3,
    max_turn_tokens: int = 8,
) -> list[dict[str, Any]]:
    """Run ``samples`` episodes per prompt (prompt-major) with HF ``generate``: each turn samples up
    to ``max_turn_tokens`` tokens and stops at ``]`` or ``<eos>``; a turn ending with ``]`` gets
    ``tool_observation``'s tokens appended and the episode goes on, up to ``max_turns`` turns (an
    observation no turn would read is not appended).  All live episodes share one ``generate``
    call per turn.  Per episode: ``completion`` (text after the prompt, no ``<eos>``),
    ``tool_calls``, ``turns``."""
    vocab = tokenizer.get_vocab()
    eos, pad, close = tokenizer.eos_token_id, tokenizer.pad_token_id, vocab[CALL_CLOSE]
    limit = int(getattr(model.config, "max_position_embeddings", 10**9))
    seqs = [list(tokenizer(p)["input_ids"]) for p in prompts for _ in range(samples)]
    starts = [len(s) for s in seqs]
    calls = [0] * len(seqs)
    turns = [0] * len(seqs)
    live = list(range(len(seqs)))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for turn in range(max_turns):
            width = max((len(seqs[i]) for i in live), default=0)
            room = min(max_turn_tokens, limit - width)
            if not live or room <= 0:
                break
            ids = torch.full((len(live), width), pad, dtype=torch.long)
            mask = torch.zeros((len(live), width), dtype=torch.long)
            for row, i in enumerate(live):  # left padding
                ids[row, width - len(seqs[i]) :] = torch.tensor(seqs[i])
                mask[row, width - len(seqs[i]) :] = 1
            if temperature > 0:
                sampling: dict[str, Any] = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
            else:
                sampling = dict(do_sample=False)
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=room,
                eos_token_id=[eos, close],
                pad_token_id=pad,
                **sampling,
            )[:, width:].tolist()
            still = []
            for row, i in enumerate(live):
                new = out[row]
                stop = next((k for k, t in enumerate(new) if t in (eos, close)), None)
                new = new if stop is None else new[: stop + 1]
                seqs[i] += new
                turns[i] += 1
                if stop is None or new[-1] != close:
                    continue  # eos or out of tokens: the episode is over
                calls[i] += 1
                if turn + 1 < max_turns:
                    text = tokenizer.decode(new, skip_special_tokens=True)
                    obs = tokenizer(tool_observation(text), add_special_tokens=False)["input_ids"]
                    seqs[i] += obs
                    still.append(i)
            live = still
    return [
        {
            "completion": tokenizer.decode(s[start:], skip_special_tokens=True),
            "tool_calls": n_calls,
            "turns": n_turns,
        }
        for s, start, n_calls, n_turns in zip(seqs, starts, calls, turns)
    ]


def tool_success_rate(
    model_path,
    prompts_df: pd.DataFrame,
    samples: int = 8,
    seed: int = 0,
    temperature: float = 1.0,
    max_turns: int = 3,
    max_turn_tokens: int = 8,
    *,
    tokenizer=None,
) -> dict[str, float]:
    """Multi-turn sampling success with HF ``generate`` (``tool_episodes``), scored with
    ``tool_answer_exact``: ``{"success", "tool_call_rate", "tool_success"}`` (the share of episodes
    that called the tool at least once, and the success among those; nan when none did).

    ``model_path`` is a folder from ``build_tiny_tool_model`` or an already loaded model (then pass
    ``tokenizer`` or it is rebuilt with ``build_tool_tokenizer``).  A reference for tests and for
    checking the warm-up, not the production rollout (operators/engines/rollout.py).
    """
    model, tokenizer = load_model(model_path, tokenizer, build_tool_tokenizer)
    prompts = list(prompts_df["prompt"])
    answers = [str(a) for a in prompts_df["answer"]]
    if not prompts:
        return {"success": float("nan"), "tool_call_rate": float("nan"), "tool_success": float("nan")}
    was_training = model.training
    model.eval()
    try:
        episodes = tool_episodes(model, tokenizer, prompts, samples, seed, temperature, max_turns, max_turn_tokens)
    finally:
        if was_training:
            model.train()
    targets = [a for a in answers for _ in range(samples)]
    rewards = np.array(tool_answer_exact([e["completion"] for e in episodes], targets))
    called = np.array([e["tool_calls"] > 0 for e in episodes])
    return {
        "success": float(rewards.mean()),
        "tool_call_rate": float(called.mean()),
        "tool_success": float(rewards[called].mean()) if called.any() else float("nan"),
    }
