"""Reward functions used by tests (importable as 'reward_fixtures:NAME' from tests/)."""


def flaky_length(completions, **kwargs):
    """Raises on the whole batch if any completion contains '7'; per sample only for those."""
    if any("7" in text for text in completions):
        raise RuntimeError("cannot score a 7")
    return [float(len(text)) for text in completions]


def none_for_empty(completions, answer):
    """Names only the column it needs; returns None for empty completions."""
    return [None if not text else float(text == target) for text, target in zip(completions, answer)]


def hang_on_seven(completions, **kwargs):
    """Never answers if any completion contains '7' (a stuck reward function); else the length."""
    if any("7" in text for text in completions):
        import time

        while True:
            time.sleep(3600)
    return [float(len(text)) for text in completions]


def process_id(completions, **kwargs):
    """The pid of the process that runs it, per completion: shows where a reward function ran."""
    import os

    return [float(os.getpid())] * len(completions)


def exit_on_seven(completions, **kwargs):
    """Kills the process that runs it if any completion contains '7' (a crashing extension); else 1.0."""
    if any("7" in text for text in completions):
        import os

        os._exit(3)
    return [1.0] * len(completions)


def troublemaker(completions, prompt_id, answer, **kwargs):
    """arithmetic_exact, except: hangs forever on prompt arith-00003 (a stuck reward function), and
    gives the first sample of prompt arith-00007 a reward of 1e308, finite in float64 but inf once
    the trainer casts advantages to float32 (with an advantage that is not divided by the std)."""
    import time

    from operators.reward import arithmetic_exact

    if "arith-00003" in prompt_id:
        while True:
            time.sleep(3600)
    scores = arithmetic_exact(completions, answer)
    first = {}
    for index, pid in enumerate(prompt_id):
        if pid == "arith-00007" and pid not in first:
            first[pid] = index
            scores[index] = 1e308
    return scores


def slow_exact(completions, answer, **kwargs):
    """arithmetic_exact, a quarter of a second late: paces a fault test's job so that a kill decided
    on the step the driver reports lands while that step's neighbours are still being made."""
    return _exact_after(0.25, completions, answer, **kwargs)


def slower_exact(completions, answer, **kwargs):
    """arithmetic_exact, a second late: paces a job whose kill is decided from logs that arrive late
    (`streamrl submit` polls the job's logs every second)."""
    return _exact_after(1.0, completions, answer, **kwargs)


def _exact_after(seconds, completions, answer, **kwargs):
    import time

    from operators.reward import arithmetic_exact

    time.sleep(seconds)
    return arithmetic_exact(completions, answer=answer, **kwargs)


# Tools (operators/environment.py, ToolEnvironment), as 'reward_fixtures:NAME'.
def raising_tool(arguments):
    raise RuntimeError(f"cannot do {arguments}")


def hanging_tool(arguments):
    import time

    while True:
        time.sleep(3600)


def number_tool(arguments):
    return 42  # not a string


def echo_tool(arguments):
    return arguments[::-1]


class Chatter:
    """An environment that never ends an episode: every turn (one digit: each digit is a stop string)
    gets the observation '+1='. Only max_turns and the token budget end its episodes."""

    stop = tuple("0123456789")

    def reset(self, row):
        self.answer = row["answer"]

    def step(self, turn):
        from operators.environment import EnvStep

        return EnvStep(observation="+1=", reward=0.25)


def flaky_calculator(expression):
    """The calculator, except that it raises on a '7' and returns a number (not a string) on a '5'."""
    from operators.environment import calculator

    if "7" in expression:
        raise RuntimeError("seven")
    if "5" in expression:
        return 5
    return calculator(expression)


class WrongAnswers:
    """An environment whose answers are wrong, one way per dataset row (`answer`): a reward that is text,
    a NaN reward, or an observation that is not text. Each must end its own episode as an environment
    error, not the group or the step."""

    stop = tuple("0123456789")

    def reset(self, row):
        self.kind = row["answer"]

    def step(self, turn):
        from operators.environment import EnvStep

        return {"text": EnvStep(reward="high"), "nan": EnvStep(reward=float("nan")),
                "observation": EnvStep(observation=42, reward=1.0), "fine": EnvStep(observation="+1=", reward=0.5)
                }[self.kind]
