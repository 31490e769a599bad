"""Reward functions used by tests (importable as 'reward_fixtures:NAME' from tests/)."""


def flaky_length(completions, **kwargs):
    """Raises on the whole batch if any completion contains '7'; per sample only for those."""
    if any("7" in text for text in completions):
        raise RuntimeError("cannot score a 7")
    return [float(len(text)) for text in completions]


def none_for_empty(completions, answer):
    """Names only the column it needs; returns None for empty completions."""
    return [None if not text else float(text == target) for text, target in zip(completions, answer)]
