"""Tests for pipelines/data/tiny.py and tiny_build.py: tokenizer, dataset, reward, cached tiny model build."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from pipelines.data.model_cache import MARKER_FILE, default_cache_dir  # noqa: E402
from pipelines.data.tiny import arithmetic_exact, build_char_tokenizer, make_arithmetic_dataset, success_rate  # noqa: E402
from pipelines.data.tiny_build import build_tiny_model  # noqa: E402


# ----------------------------------------------------------------------------- tokenizer


def test_tokenizer_round_trip_no_spaces_bos_left_pad():
    tok = build_char_tokenizer()
    ids = tok("12+7=")["input_ids"]
    assert ids[0] == tok.bos_token_id
    assert tok.eos_token_id not in ids
    assert tok.convert_ids_to_tokens(ids) == ["<bos>", "1", "2", "+", "7", "="]
    assert tok.decode(ids, skip_special_tokens=True) == "12+7="
    assert tok.decode(ids) == "<bos>12+7="
    assert tok.decode(tok.convert_tokens_to_ids(["1", "2"])) == "12"
    assert tok.decode(tok(" 1 2")["input_ids"], skip_special_tokens=True) == " 1 2"

    assert tok.padding_side == "left"
    batch = tok(["1+1=", "12+13="], padding=True)
    assert batch["input_ids"][0][:2] == [tok.pad_token_id] * 2
    assert batch["attention_mask"][0][:2] == [0, 0]
    assert batch["input_ids"][0][2] == tok.bos_token_id

    for name in ("pad", "bos", "eos", "unk"):
        assert getattr(tok, f"{name}_token") == f"<{name}>"
    assert tok.apply_chat_template([{"role": "user", "content": "3+4="}], tokenize=False) == "3+4="


# ------------------------------------------------------------------------------- dataset


def test_dataset_deterministic_and_columns():
    a = make_arithmetic_dataset(20, seed=3)
    b = make_arithmetic_dataset(20, seed=3)
    c = make_arithmetic_dataset(20, seed=4)
    assert list(a.columns) == ["prompt_id", "prompt", "answer"]
    assert a.equals(b)
    assert not a.equals(c)
    assert a.prompt_id.tolist() == [f"arith-{i:05d}" for i in range(20)]
    assert a.prompt.is_unique  # distinct while there are enough problems
    for prompt, answer in zip(a.prompt, a.answer):
        x, y = prompt.rstrip("=").split("+")
        assert prompt.endswith("=") and 0 <= int(x) <= 9 and 0 <= int(y) <= 9
        assert answer == str(int(x) + int(y))


def test_dataset_with_replacement_beyond_distinct_problems():
    big = make_arithmetic_dataset(250, seed=1, max_operand=9)
    assert len(big) == 250 and big.prompt_id.is_unique
    assert big.prompt.nunique() == 100  # all 100 distinct problems, then repeats
    assert big.equals(make_arithmetic_dataset(250, seed=1))
    small = make_arithmetic_dataset(10, seed=0, max_operand=2)
    assert small.prompt.nunique() == 9
    assert make_arithmetic_dataset(0).empty


# -------------------------------------------------------------------------------- reward


def test_arithmetic_exact_cases():
    completions = ["8", " 8", "8<eos>", "8 apples", "9", "", "88", "-1", "-1", "x8"]
    answers = ["8", "8", "8", "8", "8", "8", "8", "-1", "1", "8"]
    expected = [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0]
    assert arithmetic_exact(completions, answer=answers, prompt=["?"] * len(answers)) == expected
    with pytest.raises(ValueError):
        arithmetic_exact(["1"], answer=["1", "2"])


# --------------------------------------------------------------------------------- model


def test_default_cache_dir_env(monkeypatch, tmp_path):
    monkeypatch.setenv("STREAMRL_CACHE", str(tmp_path))
    assert default_cache_dir() == tmp_path / "models"
    monkeypatch.delenv("STREAMRL_CACHE")
    assert default_cache_dir() == Path("~/.cache/streamrl/models").expanduser()


def test_unknown_build_parameter_rejected(tmp_path):
    with pytest.raises(TypeError):
        build_tiny_model(tmp_path, warmup_stepz=3)
    assert not any(tmp_path.iterdir())


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    cache = tmp_path_factory.mktemp("streamrl-cache")
    return cache, build_tiny_model(cache)


def test_build_tiny_model_loadable(built):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cache, path = built
    assert path.parent == cache and (path / MARKER_FILE).is_file()
    assert [p.name for p in cache.iterdir()] == [path.name]  # no temp folder left
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    cfg = model.config
    assert cfg.model_type == "llama"
    assert cfg.hidden_size // cfg.num_attention_heads >= 32
    assert cfg.vocab_size == len(tok) == model.get_output_embeddings().weight.shape[0]
    assert not cfg.tie_word_embeddings
    assert tok.padding_side == "left"
    assert tok("12+7=")["input_ids"] == build_char_tokenizer()("12+7=")["input_ids"]
    assert tok.decode(tok("12+7=")["input_ids"], skip_special_tokens=True) == "12+7="
    assert (cfg.pad_token_id, cfg.bos_token_id, cfg.eos_token_id) == (
        tok.pad_token_id,
        tok.bos_token_id,
        tok.eos_token_id,
    )


def test_build_tiny_model_cached(built):
    cache, path = built
    marker = path / MARKER_FILE
    mtime = marker.stat().st_mtime_ns
    t0 = time.perf_counter()
    again = build_tiny_model(cache)
    assert again == path
    assert time.perf_counter() - t0 < 1.0
    assert marker.stat().st_mtime_ns == mtime
    # a different knob is a different folder (not built here: just the name)
    from pipelines.data.model_cache import _params_hash
    from pipelines.data.tiny_build import _build_params

    assert _params_hash(_build_params(0, {})) in path.name
    assert _params_hash(_build_params(0, {"warmup_correct_prob": 0.2})) not in path.name
    assert _params_hash(_build_params(1, {})) not in path.name


def test_initial_success_rate_band(built):
    _, path = built
    df = make_arithmetic_dataset(100, seed=0)
    rate = success_rate(path, df, samples=8, seed=0)
    assert 0.03 <= rate <= 0.5, rate
    assert rate == success_rate(path, df, samples=8, seed=0)  # seeded
