"""Agents used by tests (importable as 'agent:agent_fixtures:NAME' from tests/), written against the openai client
alone, as a user writes them (operators/environments/agents.py)."""

from __future__ import annotations

import time

REFUSED: list[object] = []  # what a call made after its episode's time ran out got back (overstays)


def two_completions(client, row):
    """One token after the prompt, then the prompt, that token and '+0=' again: the second call's prompt extends
    the first call's tokens when the text re-tokenises to them. The reward: the first token was the answer."""
    first = client.completions.create(model="policy", prompt=row["prompt"], max_tokens=1)
    text = first.choices[0].text
    client.completions.create(model="policy", prompt=row["prompt"] + text + "+0=", max_tokens=3)
    return float(text.strip() == str(row["answer"]))


async def fails_on_odd(client, row):
    """An async agent (its client is an openai.AsyncOpenAI): calls once, then raises for an odd answer."""
    await client.completions.create(model="policy", prompt=row["prompt"], max_tokens=2)
    if int(row["answer"]) % 2:
        raise KeyError("odd")
    return 0.5


def overstays(client, row, *, sleep_s: float = 4.0):
    """Sleeps past its episode's time, then calls: the endpoint refuses the call (the episode ended)."""
    time.sleep(sleep_s)
    try:
        client.completions.create(model="policy", prompt=row["prompt"], max_tokens=2)
        REFUSED.append("answered")
    except Exception as err:  # noqa: BLE001 - the refusal is what the test reads
        REFUSED.append(getattr(err, "status_code", repr(err)))
    return 1.0


def talks_on(client, row):
    """Calls until the endpoint refuses (its max_turns), then lets the refusal raise."""
    for _ in range(10):
        client.completions.create(model="policy", prompt=row["prompt"], max_tokens=1)
    return 1.0
