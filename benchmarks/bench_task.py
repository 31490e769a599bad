"""Reward of the throughput benchmark (`benchmarks.bench_task:digit_fraction` in benchmarks/throughput.yaml).

The benchmark's policy is an untrained Llama: its responses are random characters of
long-tailed length. This reward (the share of digits in a response) varies within every
group, so advantages and gradients are non-zero and the trainer does real work.
"""


def digit_fraction(completions: list[str], **kwargs) -> list[float]:
    return [sum(ch.isdigit() for ch in text) / max(len(text), 1) for text in completions]
