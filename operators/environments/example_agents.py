"""Agents written against the `openai` client alone, as a user would write them (no streamrl import): the
examples of operators/environments/agents.py, used by configs/tiny_agent.yaml and the tests.

    rollout:
      environment: {name: "agent:operators.environments.example_agents:add_by_completion"}
"""

from __future__ import annotations

import re

NUMBER = re.compile(r"-?\d+")


def first_number(text: str) -> str | None:
    found = NUMBER.search(text or "")
    return found.group(0) if found else None


def add_by_completion(client, row, *, max_tokens: int = 4) -> float:
    """One completion of the row's text prompt ('3+4='); 1.0 when the number it starts with is the answer."""
    reply = client.completions.create(model="policy", prompt=row["prompt"], max_tokens=max_tokens)
    leading = re.match(r"\s*(-?\d+)", reply.choices[0].text)
    return float(bool(leading) and leading.group(1) == str(row["answer"]).strip())


def add_by_chat(client, row, *, max_tokens: int = 32, nudge: str = "Answer with the number only.") -> float:
    """A chat: the row's prompt (messages, or text as one user message); when the reply holds no number, the
    whole conversation again with a nudge, and the second reply counts. 1.0 when the last number of the reply
    that counts is the answer."""
    prompt = row["prompt"]
    messages = [dict(m) for m in prompt] if isinstance(prompt, list) else [{"role": "user", "content": str(prompt)}]
    reply = client.chat.completions.create(model="policy", messages=messages, max_tokens=max_tokens)
    text = reply.choices[0].message.content or ""
    if first_number(text) is None:
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": nudge}]
        reply = client.chat.completions.create(model="policy", messages=messages, max_tokens=max_tokens)
        text = reply.choices[0].message.content or ""
    numbers = NUMBER.findall(text)
    return float(bool(numbers) and numbers[-1] == str(row["answer"]).strip())
