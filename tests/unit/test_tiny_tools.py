"""Tests for pipelines/data/tiny_tools.py: tokenizer, dataset, calculator, reward, the warmed-up tool model."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from pipelines.data.model_cache import MARKER_FILE  # noqa: E402
from pipelines.data.tiny import build_char_tokenizer  # noqa: E402
from pipelines.data.tiny_tools import (  # noqa: E402
    build_tiny_tool_model,
    build_tool_tokenizer,
    calculator,
    make_tool_dataset,
    split_tool_problems,
    tool_answer_exact,
    tool_observation,
    tool_success_rate,
)

# ----------------------------------------------------------------------------- tokenizer


def test_tool_tokenizer_extends_the_arithmetic_one():
    old, new = build_char_tokenizer(), build_tool_tokenizer()
    old_vocab, new_vocab = old.get_vocab(), new.get_vocab()
    assert {k: new_vocab[k] for k in old_vocab} == old_vocab  # no id moved
    assert [new_vocab[ch] for ch in "[]{}"] == list(range(len(old_vocab), len(old_vocab) + 4))
    assert len(old_vocab) == 19 and "[" not in old_vocab  # the arithmetic tokenizer is unchanged
    text = "47+38=[47+38]{85}85"
    ids = new(text)["input_ids"]
    assert ids[0] == new.bos_token_id and len(ids) == len(text) + 1
    assert new.decode(ids, skip_special_tokens=True) == text
    assert new.unk_token_id not in ids


# ------------------------------------------------------------------------------- dataset


def test_tool_dataset_deterministic_and_columns():
    a = make_tool_dataset(50, seed=3)
    assert list(a.columns) == ["prompt_id", "prompt", "answer"]
    assert a.equals(make_tool_dataset(50, seed=3))
    assert not a.equals(make_tool_dataset(50, seed=4))
    assert a.prompt_id.tolist() == [f"tools-{i:05d}" for i in range(50)]
    assert a.prompt.is_unique
    for prompt, answer in zip(a.prompt, a.answer):
        x, y = prompt.removesuffix("=").split("+")
        assert prompt.endswith("=") and 10 <= int(x) <= 99 and 10 <= int(y) <= 99
        assert answer == str(int(x) + int(y))
    assert make_tool_dataset(0).empty


def test_tool_splits_disjoint_and_stable():
    train, held, everything = (set(split_tool_problems(s)) for s in ("train", "heldout", "all"))
    assert len(everything) == 90 * 90
    assert len(held) == 1620 and not train & held and train | held == everything
    h = make_tool_dataset(5000, seed=0, split="heldout")
    assert len(h) == 1620 and h.prompt.is_unique  # never repeats a held-out problem
    assert h.prompt_id.tolist()[:2] == ["tools-heldout-00000", "tools-heldout-00001"]
    t = make_tool_dataset(200, seed=7, split="train")
    assert not set(t.prompt) & set(h.prompt)
    # the split does not move with the sampling seed
    assert set(make_tool_dataset(1620, seed=1, split="heldout").prompt) == set(h.prompt)
    with pytest.raises(ValueError):
        make_tool_dataset(3, split="test")


# ----------------------------------------------------------------------- tool, reward


def test_calculator_cases():
    assert calculator("47+38") == "85"
    assert calculator(" 2 * (3 + 4) - 5 ") == "9"
    assert calculator("-3*-3") == "9"
    assert calculator("10-99") == "-89"
    assert calculator("999999*1000000") == str(999999 * 1000000)
    assert calculator("(" * 99 + "1" + ")" * 99) == "1"
    for bad in [
        "__import__('os')",
        "__import__('os').system('true')",
        "2**99",
        "2**3",
        "x+1",
        "abs(-1)",
        "1.5+1",
        "7/2",
        "7//2",
        "'a'*3",
        "True+1",
        "[1]",
        "",
        "1+",
        "47+38]",
        "1" * 13,  # over 10**12
        "1000000*1000000*1000000",  # intermediate values are bounded too
        "1+" * 100 + "1",  # over 200 characters
    ]:
        with pytest.raises(ValueError):
            calculator(bad)


def test_tool_observation():
    assert tool_observation("[47+38]") == "{85}"
    assert tool_observation("12[47+38]") == "{85}"  # the call is after the last "["
    assert tool_observation("[2**9]") == "{error}"
    assert tool_observation("47+38]") == "{error}"
    assert tool_observation("85") is None
    assert tool_observation("[47+38") is None


def test_tool_answer_exact_cases():
    completions = [
        "[47+38]{85}85",  # the tool episode
        "85",  # a direct answer
        " 85",
        "[47+38]{85}",  # stopped after the observation: no answer
        "[47+38]{85}84",
        "[47+38]{84}85",  # the final answer counts, not the observation
        "[47+38]",
        "{1}2{3}85",  # the last "}" counts
        "85[47+38]{85}",
        "[47+38]{85}85+1",
        "",
    ]
    expected = [1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 0.0, 1.0, 0.0]
    assert tool_answer_exact(completions, answer=["85"] * len(completions), prompt=["47+38="] * 11) == expected
    with pytest.raises(ValueError):
        tool_answer_exact(["1"], answer=["1", "2"])


def test_warmup_loss_only_on_the_models_tokens():
    import torch

    from pipelines.data.tiny_tools import DEFAULT_TOOL_WARMUP, _ToolWarmupData

    tok = build_tool_tokenizer()
    w = dict(DEFAULT_TOOL_WARMUP, warmup_batch_size=16, warmup_clean_direct_rows=0.0)
    ids, mask, target, weight = _ToolWarmupData(tok, w, torch.Generator().manual_seed(0)).batch(noisy=False)
    for row in range(16):
        text = tok.decode(ids[row], skip_special_tokens=True)
        x, rest = text.split("=", 1)
        # positions whose next token is trained: "[a+b]" and the answer + eos, never the prompt or "{c}"
        predicted = [tok.convert_ids_to_tokens(int(t.argmax())) for t, wt in zip(target[row], weight[row]) if wt > 0]
        answer = rest.rpartition("}")[2]
        assert "".join(predicted) == f"[{x}]" + answer + "<eos>"


# --------------------------------------------------------------------------------- model


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    cache = tmp_path_factory.mktemp("streamrl-cache")
    t0 = time.perf_counter()
    path = build_tiny_tool_model(cache)
    return cache, path, time.perf_counter() - t0


def test_unknown_build_parameter_rejected(tmp_path):
    with pytest.raises(TypeError):
        build_tiny_tool_model(tmp_path, warmup_tool_probz=0.3)
    assert not any(tmp_path.iterdir())


def test_tool_model_loadable(built):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cache, path, _ = built
    assert path.parent == cache and path.name.startswith("tiny-llama-tools-") and (path / MARKER_FILE).is_file()
    assert [p.name for p in cache.iterdir()] == [path.name]  # no temp folder left
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    cfg = model.config
    assert cfg.model_type == "llama" and cfg.hidden_size // cfg.num_attention_heads >= 32
    assert cfg.vocab_size == len(tok) == 23
    assert tok("47+38=[")["input_ids"] == build_tool_tokenizer()("47+38=[")["input_ids"]
    ids = (cfg.pad_token_id, cfg.bos_token_id, cfg.eos_token_id)
    assert ids == (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id)


def test_tool_model_cached_and_deterministic_name(built):
    from pipelines.data.tiny_tools import _build_params
    from pipelines.data.model_cache import _params_hash

    cache, path, seconds = built
    assert seconds < 120, seconds
    mtime = (path / MARKER_FILE).stat().st_mtime_ns
    t0 = time.perf_counter()
    assert build_tiny_tool_model(cache) == path
    assert time.perf_counter() - t0 < 1.0
    assert (path / MARKER_FILE).stat().st_mtime_ns == mtime
    assert path.name == f"tiny-llama-tools-{_params_hash(_build_params(0, {}))}"
    assert _params_hash(_build_params(0, {"warmup_tool_prob": 0.25})) not in path.name
    assert _params_hash(_build_params(1, {})) not in path.name


def test_initial_tool_success_band(built):
    _, path, _ = built
    df = make_tool_dataset(64, seed=0, split="heldout")
    rates = tool_success_rate(path, df, samples=8, seed=0)
    assert 0.05 <= rates["success"] <= 0.45, rates
    assert rates["tool_call_rate"] < 0.5, rates
    assert rates["tool_success"] > 0.6, rates  # when it calls the tool, it copies call and result
    assert rates == tool_success_rate(path, df, samples=8, seed=0)  # seeded


def test_protocol_needs_the_observation(built):
    _, path, _ = built
    df = make_tool_dataset(32, seed=2, split="train")
    # one turn: a call is never answered, so only (rare, lucky) direct answers score
    one = tool_success_rate(path, df, samples=8, seed=0, max_turns=1)
    assert one["tool_call_rate"] > 0.05 and one["tool_success"] == 0.0
    assert one["success"] < 0.05
