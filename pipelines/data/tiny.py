"""Tiny model and task for streamrl: everything is built locally, no hub access.

* ``build_char_tokenizer``: a character-level ``PreTrainedTokenizerFast``
  (``<pad>``, ``<bos>``, ``<eos>``, ``<unk>``; bos prepended, no eos; left padding;
  decode joins characters without spaces).
* ``make_arithmetic_dataset``: deterministic ``"a+b="`` -> ``"c"`` prompts, from all problems
  or from disjoint "train" / "heldout" splits (``split_problems``).
* ``arithmetic_exact``: TRL-style reward function (1.0 / 0.0).
* ``success_rate``: sampling success rate with HF ``generate``.

The model itself, a small ``LlamaForCausalLM`` warmed up on this task and cached, is built by
pipelines/data/tiny_build.py (``build_tiny_model``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from operators.stages.reward import arithmetic_exact  # the task's reward, kept with the other builtins

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = [PAD, BOS, EOS, UNK]
# Order matters: the token ids are part of every saved model.
CHARS = list("0123456789+-*= ")

CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['content'] }}{% endfor %}"
)

# The tiny Llama's shape (pipelines/data/tiny_build.py builds it; the tokenizer's length limit is its context).
DEFAULT_MODEL_CONFIG: dict[str, Any] = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,  # head_dim 32: vLLM's CPU attention kernel needs >= 32
    num_key_value_heads=2,
    intermediate_size=256,
    max_position_embeddings=64,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    # ~1/sqrt(hidden_size): HF's default 0.02 suits wide models; here it leaves weights
    # so small that Adam's lr-sized RL steps wreck the policy within a few steps.
    initializer_range=0.1,
)


# --------------------------------------------------------------------------- tokenizer


def build_char_tokenizer(chars: list[str] | None = None):
    """Character-level tokenizer; ``encode`` adds ``<bos>`` (never ``<eos>``).

    ``chars``: the characters after the special tokens (default ``CHARS``); a task that needs
    more appends them, so the ids of ``CHARS`` do not move (pipelines/data/tiny_tools.py)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + list(CHARS if chars is None else chars))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # Every single character (space included) is its own token.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()  # join with no separator
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A",
        pair=f"{BOS} $A $B",
        special_tokens=[(BOS, vocab[BOS])],
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        padding_side="left",
        truncation_side="left",
        clean_up_tokenization_spaces=False,
        model_max_length=DEFAULT_MODEL_CONFIG["max_position_embeddings"],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


# ----------------------------------------------------------------------------- dataset


def _all_problems(max_operand: int) -> list[tuple[str, str]]:
    return [
        (f"{a}+{b}=", str(a + b))
        for a in range(max_operand + 1)
        for b in range(max_operand + 1)
    ]


# The held-out split: a fixed share of the problems, chosen by a seed of its own so that it does not move
# with data.seed. RL never trains on them (the "train" split excludes them); the warm-up that builds the
# tiny model saw every problem, the way a pretrained model has seen arithmetic.
SPLITS = ("all", "train", "heldout")
HELDOUT_FRACTION = 0.2
HELDOUT_SEED = 20261201


def split_problems(max_operand: int, split: str) -> list[tuple[str, str]]:
    """The problems of one split: "all", "train" (never held out) or "heldout" (disjoint from "train")."""
    return choose_split(_all_problems(max_operand), split, HELDOUT_SEED)


def choose_split(problems: list, split: str, seed: int) -> list:
    """`problems` of one split: all, train or heldout (HELDOUT_FRACTION of them, chosen by `seed`)."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; use one of {list(SPLITS)}")
    if split == "all":
        return problems
    order = np.random.default_rng(seed).permutation(len(problems))
    held = max(1, round(HELDOUT_FRACTION * len(problems)))
    chosen = sorted(order[:held]) if split == "heldout" else sorted(order[held:])
    return [problems[i] for i in chosen]


def make_arithmetic_dataset(
    num_prompts: int, seed: int = 0, max_operand: int = 9, split: str = "all"
) -> pd.DataFrame:
    """``num_prompts`` addition problems ``"a+b="`` (0 <= a, b <= max_operand) from ``split``.

    Deterministic for ``seed``.  Distinct problems while there are enough of them
    (a seeded permutation); beyond that, the rest is drawn with replacement, except from the
    "heldout" split, which never repeats a problem (at most its size is returned).
    ``prompt_id`` is the row position, e.g. ``"arith-00017"`` (``"arith-heldout-00003"``).
    """
    return problem_table(split_problems(max_operand, split), num_prompts, seed, split, "arith")


def problem_table(problems: list[tuple[str, str]], num_prompts: int, seed: int, split: str, name: str) -> pd.DataFrame:
    """`num_prompts` of (prompt, answer) `problems` as a dataset (prompt_id, prompt, answer): a seeded
    permutation while there are enough, then drawn with replacement, except from "heldout", which never
    repeats one. prompt ids `<name>-00017`, `<name>-heldout-00003`."""
    if num_prompts < 0:
        raise ValueError("num_prompts must be >= 0")
    if split == "heldout":
        num_prompts = min(num_prompts, len(problems))
    rng = np.random.default_rng(seed)
    n_distinct = min(num_prompts, len(problems))
    idx = list(rng.permutation(len(problems))[:n_distinct])
    if num_prompts > n_distinct:
        idx += list(rng.integers(0, len(problems), size=num_prompts - n_distinct))
    prefix = f"{name}-heldout" if split == "heldout" else name
    return pd.DataFrame(
        {
            "prompt_id": [f"{prefix}-{i:05d}" for i in range(num_prompts)],
            "prompt": [problems[j][0] for j in idx],
            "answer": [problems[j][1] for j in idx],
        }
    )


# ---------------------------------------------------------------------------- evaluate


def load_model(model_path, tokenizer, make_tokenizer):
    """(model, tokenizer) of a folder (its own tokenizer unless one is given), or of an already loaded
    model (with `tokenizer`, else `make_tokenizer()`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not isinstance(model_path, (str, Path)):
        return model_path, tokenizer if tokenizer is not None else make_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(model_path, local_files_only=True)
    if tokenizer is None:
        tokenizer = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
    return model, tokenizer


@torch.no_grad()
def success_rate(
    model_path,
    prompts_df: pd.DataFrame,
    samples: int = 8,
    seed: int = 0,
    *,
    max_new_tokens: int = 4,
    temperature: float = 1.0,
    tokenizer=None,
) -> float:
    """Fraction of ``samples`` sampled completions per prompt that ``arithmetic_exact``
    scores 1.0 (HF ``generate``, ``do_sample=True``, eos stops).

    ``model_path`` is a folder from ``build_tiny_model`` or an already loaded model
    (then pass ``tokenizer`` or it is rebuilt with ``build_char_tokenizer``).
    """
    model, tokenizer = load_model(model_path, tokenizer, build_char_tokenizer)
    was_training = model.training
    model.eval()
    prompts = list(prompts_df["prompt"])
    answers = [str(a) for a in prompts_df["answer"]]
    if not prompts:
        return float("nan")
    enc = tokenizer(prompts, return_tensors="pt", padding=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        out = model.generate(
            **enc,
            do_sample=True,
            temperature=temperature,
            top_k=0,
            top_p=1.0,
            max_new_tokens=max_new_tokens,
            num_return_sequences=samples,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=False)
    rewards = arithmetic_exact(texts, [a for a in answers for _ in range(samples)])
    if was_training:
        model.train()
    return float(np.mean(rewards))
