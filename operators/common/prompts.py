"""Prompts as the model reads them: plain text or chat messages, rendered in one place.

A prompt cell holds either text or chat messages (a list of `{role, content}`). `PromptRenderer` turns
it into the token ids every stage uses: Generate encodes with it (the reference model and the trainer
read Generate's `prompt_token_ids`), the driver counts prompt lengths with it before anything starts,
and the rendered text goes to the rollouts and `streamrl lineage` as `prompt_text`.

    renderer = PromptRenderer(tokenizer, PromptFormat(chat_template="auto", system_prompt="Be brief."))
    ids = renderer.encode(["What is 2 + 3?", [{"role": "user", "content": "Hi"}]])

`chat_template`:
- "auto": the tokenizer's chat template, with the generation prompt (`add_generation_prompt=True`),
  when a prompt is messages or a system prompt is set; a text prompt with no system prompt is encoded as
  it is (what a base model or the tiny builtin task expects, TRL's convention for non-conversational data);
- "none": never a template (text prompts only; messages are an error);
- a path to a Jinja file: that template, for every prompt.

A rendered chat prompt is encoded without the tokenizer's special tokens (the template writes the ones
it wants, BOS included); plain text keeps them (BOS where the tokenizer adds it), as the engines did.

`stop_token_ids` gives the tokens that end a response: the model's generation config's `eos_token_id`
(an int or a list; Llama 3 and Qwen list two) and the tokenizer's EOS.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Sequence

ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class PromptFormat:
    chat_template: str = "auto"  # "auto" | "none" | a path to a Jinja template file
    system_prompt: str | None = None


class PromptError(ValueError):
    """A prompt or a template cannot be rendered; the message says what and the fix."""


def message_problem(prompt: Any) -> str | None:
    """What is wrong with a chat-message prompt (None when it is well formed)."""
    messages = as_messages(prompt)
    if messages is None:
        return "is not a list of {role, content} messages"
    if not messages:
        return "is an empty list of messages"
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            return f"message {index} is a {type(message).__name__}, not a {{role, content}} mapping"
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            return f"message {index} has role {role!r}; use one of {list(ROLES)}"
        if not isinstance(content, str):
            return f"message {index} has no text content (got {type(content).__name__})"
    if messages[-1]["role"] == "assistant":
        return "ends with an assistant message; a prompt ends with the user's turn"
    if not any(m["role"] == "user" and m["content"].strip() for m in messages):
        return "has no user message with text"
    return None


def as_messages(prompt: Any) -> list | None:
    """A prompt cell as a list of plain dicts, or None when it is not a list (text, a number, None).

    Cells come as Python lists, numpy arrays (a list column of a pandas batch from Arrow) or tuples, and
    messages as dicts (pyarrow struct values become dicts); extra keys with null values (Arrow fills the
    union of the struct's fields) are dropped."""
    if isinstance(prompt, (str, bytes, dict)) or prompt is None or not hasattr(prompt, "__len__"):
        return None
    if not isinstance(prompt, (list, tuple)) and not hasattr(prompt, "tolist"):
        return None
    items = prompt.tolist() if hasattr(prompt, "tolist") else list(prompt)
    if not isinstance(items, list):
        return None
    return [{k: v for k, v in item.items() if v is not None} if isinstance(item, dict) else item for item in items]


def is_messages(prompt: Any) -> bool:
    return as_messages(prompt) is not None


def load_template(chat_template: str) -> str | None:
    """The Jinja text of a template file, or None for "auto"/"none". Raises PromptError."""
    if chat_template in ("auto", "none"):
        return None
    path = Path(chat_template).expanduser()
    if not path.is_file():
        raise PromptError(f"chat template file {chat_template!r} does not exist; give a Jinja file, 'auto' "
                          "(the tokenizer's template) or 'none'")
    return path.read_text(encoding="utf-8")


class PromptRenderer:
    """Renders prompts with `tokenizer` (a Hugging Face tokenizer) under `fmt`."""

    def __init__(self, tokenizer, fmt: PromptFormat = PromptFormat()):
        self.tokenizer = tokenizer
        self.fmt = fmt
        self.template = load_template(fmt.chat_template)  # a file's template; None: the tokenizer's
        self.has_template = self.template is not None or bool(getattr(tokenizer, "chat_template", None))

    @cached_property
    def template_problem(self) -> str | None:
        """Why the chat template does not render a conversation (not valid Jinja, or it fails), None when it
        renders one or there is none."""
        if not self.has_template:
            return None
        try:
            self.tokenizer.apply_chat_template(self.messages([{"role": "user", "content": "1+1="}]),
                                               chat_template=self.template, tokenize=False, add_generation_prompt=True)
        except Exception as err:  # noqa: BLE001 - jinja2 and transformers raise many types; each means the same
            line = getattr(err, "lineno", None)
            what = (f"chat template file {self.fmt.chat_template!r}" if self.template is not None
                    else "the tokenizer's chat template")
            return (f"{what} does not render a conversation ({type(err).__name__}"
                    f"{f' at line {line}' if line else ''}: {' '.join(str(err).split())[:200]}); fix the template, "
                    "or use 'auto' (the tokenizer's template), 'none' (text prompts only) or another Jinja file")
        return None

    def uses_template(self, prompt: Any) -> bool:
        """Whether `prompt` is rendered with a chat template."""
        if self.fmt.chat_template == "none":
            return False
        if self.template is not None:
            return True
        return is_messages(prompt) or self.fmt.system_prompt is not None

    def problem(self, prompt: Any) -> str | None:
        """Why `prompt` cannot be rendered under this format (None when it can)."""
        if is_messages(prompt):
            if self.fmt.chat_template == "none":
                return "is chat messages, but data.chat_template is 'none'; set it to 'auto' or a template file"
            found = message_problem(prompt)
            if found:
                return found
        elif not isinstance(prompt, str):
            return f"is a {type(prompt).__name__}, neither text nor a list of messages"
        if self.uses_template(prompt) and not self.has_template:
            return ("needs a chat template (chat messages, or data.system_prompt), but the tokenizer has none; "
                    "set data.chat_template to a Jinja template file, or give text prompts without a system prompt")
        return None

    def messages(self, prompt: Any) -> list[dict]:
        """The conversation a templated prompt renders: the system prompt (unless the prompt has its own
        system message) and the prompt's messages, or one user message for text."""
        messages = as_messages(prompt)
        if messages is None:
            messages = [{"role": "user", "content": str(prompt)}]
        if self.fmt.system_prompt is not None and not (messages and messages[0].get("role") == "system"):
            messages = [{"role": "system", "content": self.fmt.system_prompt}] + messages
        return [{"role": m["role"], "content": m["content"]} for m in messages]

    def render(self, prompt: Any) -> str:
        """The prompt as the model reads it (text; the generation prompt appended when templated)."""
        if not self.uses_template(prompt):
            if not isinstance(prompt, str):
                raise PromptError(f"prompt {_short(prompt)} {self.problem(prompt)}")
            return prompt
        problem = self.problem(prompt)
        if problem:
            raise PromptError(f"prompt {_short(prompt)} {problem}")
        return self.tokenizer.apply_chat_template(
            self.messages(prompt), chat_template=self.template, tokenize=False, add_generation_prompt=True,
        )

    def encode(self, prompts: Sequence[Any]) -> list[list[int]]:
        """Token ids of each prompt, rendered (templated prompts without the tokenizer's special tokens:
        the template writes them; text with them, as `tokenizer(text)` does)."""
        templated = [self.uses_template(p) for p in prompts]
        out: list[list[int]] = [[] for _ in prompts]
        for with_template in (False, True):
            indices = [i for i, flag in enumerate(templated) if flag == with_template]
            if not indices:
                continue
            texts = [self.render(prompts[i]) for i in indices]
            encoded = self.tokenizer(texts, add_special_tokens=not with_template)["input_ids"]
            for i, ids in zip(indices, encoded):
                out[i] = list(ids)
        return out


def _short(prompt: Any, limit: int = 60) -> str:
    text = repr(prompt)
    return text if len(text) <= limit else text[:limit] + "..."


def stop_token_ids(model_path: str | None, tokenizer) -> tuple[int, ...]:
    """Token ids that end a response: the generation config's eos_token_id (int or list) and the
    tokenizer's EOS, in that order, without repeats."""
    ids: list[int] = []
    if model_path is not None:
        try:
            config = json.loads((Path(model_path) / "generation_config.json").read_text())
        except (OSError, ValueError):
            config = {}
        eos = config.get("eos_token_id")
        ids += [int(t) for t in (eos if isinstance(eos, list) else [eos]) if isinstance(t, int)]
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.append(int(tokenizer.eos_token_id))
    return tuple(dict.fromkeys(ids))


def first_stop(tokens: list[int], stop_ids: Sequence[int]) -> int | None:
    """Index of the first stop token in `tokens`, or None."""
    stops = set(stop_ids)
    return next((i for i, token in enumerate(tokens) if token in stops), None)


def cut_at_stop(tokens: list[int], stop_ids: Sequence[int]) -> list[int]:
    """`tokens` up to and including the first stop token (the stop token is kept)."""
    index = first_stop(tokens, stop_ids)
    return tokens if index is None else tokens[: index + 1]
