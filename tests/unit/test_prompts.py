"""Prompts rendered in one place (operators/common/prompts.py): text or chat messages, a system prompt, the chat
template with the generation prompt, lengths counted as rendered, stop tokens from the generation config."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from operators.common.prompts import (
    PromptError, PromptFormat, PromptRenderer, cut_at_stop, message_problem, stop_token_ids,
)
from pipelines.config.base import ConfigError
from pipelines.config.load import load_config
from pipelines.data.datasets import load_prompts
from pipelines.data.prompt_checks import validate_prompts

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def chatml_tokenizer(tmp_path_factory):
    """A byte-level BPE tokenizer with ChatML special tokens and template, saved and loaded as users' are."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(["What is 2 + 3? Answer: 5", "You are a helpful assistant.", "Hello there"],
                            vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    fast = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<|im_end|>",
                                   pad_token="<|im_end|>", bos_token="<|im_start|>")
    fast.chat_template = CHATML
    folder = tmp_path_factory.mktemp("chatml-tokenizer")
    fast.save_pretrained(folder)
    return AutoTokenizer.from_pretrained(folder, local_files_only=True)


def test_text_without_system_prompt_is_encoded_as_it_is(chatml_tokenizer):
    renderer = PromptRenderer(chatml_tokenizer, PromptFormat())
    assert renderer.render("What is 2 + 3?") == "What is 2 + 3?"
    assert renderer.encode(["What is 2 + 3?"]) == [chatml_tokenizer("What is 2 + 3?")["input_ids"]]


def test_messages_get_the_template_and_the_generation_prompt(chatml_tokenizer):
    renderer = PromptRenderer(chatml_tokenizer, PromptFormat(system_prompt="Be brief."))
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    text = renderer.render(messages)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n"
                    "<|im_start|>assistant\n")
    (ids,) = renderer.encode([messages])
    assert ids == chatml_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids[0] == chatml_tokenizer.convert_tokens_to_ids("<|im_start|>")  # the special token, not its characters
    # A text prompt with a system prompt becomes a user message; a row's own system message wins.
    assert renderer.render("What is 2 + 3?") == text
    own = [{"role": "system", "content": "Mine."}] + messages
    assert renderer.render(own).startswith("<|im_start|>system\nMine.<|im_end|>")
    # Messages as a pandas batch holds them after Arrow: a numpy array of dicts with null keys filled in.
    arrow_like = np.array([{"role": "user", "content": "What is 2 + 3?", "name": None}], dtype=object)
    assert renderer.render(arrow_like) == text


def test_a_template_file_applies_to_every_prompt(tmp_path, chatml_tokenizer):
    template = tmp_path / "plain.jinja"
    template.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
                        "{% if add_generation_prompt %}[assistant] {% endif %}")
    renderer = PromptRenderer(chatml_tokenizer, PromptFormat(chat_template=str(template)))
    assert renderer.render("Hi") == "[user] Hi\n[assistant] "
    with pytest.raises(PromptError, match="does not exist"):
        PromptRenderer(chatml_tokenizer, PromptFormat(chat_template=str(tmp_path / "missing.jinja")))


@pytest.mark.parametrize("prompt, expected", [
    ([], "empty list"),
    ([{"role": "bot", "content": "x"}], "role 'bot'"),
    ([{"role": "user", "content": 3}], "no text content"),
    ([{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}], "ends with an assistant"),
    (["just a string"], "not a {role, content} mapping"),
    ([{"role": "system", "content": "only a system prompt"}], "no user message"),
])
def test_malformed_messages_are_named(prompt, expected):
    assert expected in message_problem(prompt)


def test_none_refuses_messages_and_a_tokenizer_without_template_refuses_them(chatml_tokenizer, tiny_model_path):
    none = PromptRenderer(chatml_tokenizer, PromptFormat(chat_template="none"))
    assert "chat_template is 'none'" in none.problem([{"role": "user", "content": "x"}])
    from transformers import AutoTokenizer

    bare = AutoTokenizer.from_pretrained(tiny_model_path, local_files_only=True)
    bare.chat_template = None
    assert "tokenizer has none" in PromptRenderer(bare, PromptFormat()).problem([{"role": "user", "content": "x"}])


def test_stop_tokens_come_from_the_generation_config(tmp_path, chatml_tokenizer):
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 2]}))
    eos = chatml_tokenizer.eos_token_id
    assert stop_token_ids(str(tmp_path), chatml_tokenizer) == tuple(dict.fromkeys([7, 2, eos]))
    assert stop_token_ids(str(tmp_path / "nothing"), chatml_tokenizer) == (eos,)
    assert cut_at_stop([5, 9, 7, 3, 2], (7, 2)) == [5, 9, 7]
    assert cut_at_stop([5, 9], (7, 2)) == [5, 9]


# --- the driver's checks, as a job sees them ----------------------------------------------------


def _model_with_tokenizer(tiny_model_path: str, folder: Path, tokenizer) -> str:
    """The tiny model's weights with another tokenizer's files (for validation only: nothing generates)."""
    shutil.copytree(tiny_model_path, folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def _config(tmp_path: Path, rows: list[dict], **data):
    file = tmp_path / "prompts.jsonl"
    file.write_text("".join(json.dumps(row) + "\n" for row in rows))
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump({"data": {"path": str(file), **data}}))
    cfg = load_config(config)
    return cfg, load_prompts(cfg.data)[0]


def test_malformed_message_rows_are_listed_with_what_is_wrong(tmp_path, chatml_tokenizer, tiny_model_path):
    model = _model_with_tokenizer(tiny_model_path, tmp_path / "model", chatml_tokenizer)
    rows = [{"prompt": [{"role": "user", "content": "What is 2 + 3?"}], "answer": "5"},
            {"prompt": [{"role": "robot", "content": "hi"}], "answer": "1"},
            {"prompt": [], "answer": "1"},
            {"prompt": "plain text among messages", "answer": "1"}]
    cfg, prompts = _config(tmp_path, rows)
    with pytest.raises(ConfigError) as info:
        validate_prompts(prompts, cfg, model)
    message = "\n".join(text for path, text in info.value.problems if path == "data.path")
    assert "2 of 4 rows have malformed chat messages: row 1 (message 0 has role 'robot'" in message
    assert "row 2 (is an empty list of messages)" in message
    assert "1 of 4 rows hold another kind of prompt than the first row" in message and "row 3" in message
    cfg, prompts = _config(tmp_path, rows, invalid_prompts="drop")
    kept, report = validate_prompts(prompts, cfg, model)
    assert len(kept) == 1 and report == {"bad_messages": ["row-00000001", "row-00000002"],
                                         "mixed_kinds": ["row-00000003"]}


def test_messages_need_a_chat_template(tmp_path, tiny_model_path):
    from transformers import AutoTokenizer

    bare = AutoTokenizer.from_pretrained(tiny_model_path, local_files_only=True)
    bare.chat_template = None
    model = _model_with_tokenizer(tiny_model_path, tmp_path / "model", bare)
    (Path(model) / "chat_template.jinja").unlink(missing_ok=True)
    cfg, prompts = _config(tmp_path, [{"prompt": [{"role": "user", "content": "1+1="}], "answer": "2"}])
    with pytest.raises(ConfigError) as info:
        validate_prompts(prompts, cfg, model)
    assert "data.chat_template" in dict(info.value.problems)
    cfg, prompts = _config(tmp_path, [{"prompt": "1+1=", "answer": "2"}], system_prompt="Add.")
    with pytest.raises(ConfigError) as info:
        validate_prompts(prompts, cfg, model)
    assert "a system prompt needs a chat template" in dict(info.value.problems)["data.system_prompt"]


def test_prompt_length_is_checked_with_the_template_applied(tmp_path, chatml_tokenizer, tiny_model_path):
    """The tiny model has 64 positions: a prompt that fits as text is too long once the template and the
    system prompt are around it."""
    model = _model_with_tokenizer(tiny_model_path, tmp_path / "model", chatml_tokenizer)
    question = "What is 2 + 3? " * 3
    plain = len(chatml_tokenizer(question)["input_ids"])
    cfg, prompts = _config(tmp_path, [{"prompt": question, "answer": "5"}])
    assert plain + cfg.rollout.max_new_tokens <= 64
    kept, _ = validate_prompts(prompts, cfg, model)
    assert len(kept) == 1
    cfg, prompts = _config(tmp_path, [{"prompt": question, "answer": "5"}],
                           system_prompt="You are a helpful assistant. " * 3)
    with pytest.raises(ConfigError) as info:
        validate_prompts(prompts, cfg, model)
    assert "prompt tokens (chat template applied)" in dict(info.value.problems)["data.path"]


# --- Generate renders, with a real engine -------------------------------------------------------


def test_generate_renders_messages_and_records_the_rendered_prompt(tiny_model_path):
    from operators.stages.generate import Generate

    generate = Generate(tiny_model_path, engine="hf", n=2, max_new_tokens=3, system_prompt="")
    batch = pd.DataFrame({"prompt": [[{"role": "user", "content": "3+4="}], [{"role": "user", "content": "1+2="}]]})
    out = generate.sample(batch)
    renderer = generate.renderer()
    # the tiny template concatenates the contents: the (empty) system prompt, then the user's
    assert out["prompt_text"].tolist() == ["3+4=", "1+2="]
    assert out["prompt_token_ids"].tolist() == renderer.encode(list(batch["prompt"]))
    assert all(len(tokens) == 2 for tokens in out["response_token_ids"])


def test_hf_engine_stops_at_every_stop_token_of_the_generation_config(tmp_path, tiny_model_path):
    """A generation config that lists every digit as an end of sequence: each response ends at its first
    digit (which it keeps), or runs to max_new_tokens without one."""
    from transformers import AutoTokenizer

    from operators.engines.hf import HFEngine
    from operators.engines.base import SamplingParams

    model = tmp_path / "model"
    shutil.copytree(tiny_model_path, model)
    tokenizer = AutoTokenizer.from_pretrained(model, local_files_only=True)
    digits = [tokenizer.convert_tokens_to_ids(str(d)) for d in range(10)]
    config = json.loads((model / "generation_config.json").read_text()) if (model / "generation_config.json").exists() else {}
    (model / "generation_config.json").write_text(json.dumps({**config, "eos_token_id": digits}))
    engine = HFEngine(str(model))
    assert set(digits) <= set(engine.stop_ids)
    (group,) = engine.generate(engine.encode(["3+4="]), SamplingParams(n=8, max_new_tokens=6, seed=1))
    ended = 0
    for tokens in group.token_ids:
        stops = [i for i, token in enumerate(tokens) if token in engine.stop_ids]
        assert stops in ([], [len(tokens) - 1])  # at most one stop token, and it is the last
        assert stops or len(tokens) == 6
        ended += bool(stops)
    assert ended >= 1  # the tiny model answers digits: some response must have stopped at one
