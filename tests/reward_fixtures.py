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

    from operators.stages.reward import arithmetic_exact

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

    from operators.stages.reward import arithmetic_exact

    time.sleep(seconds)
    return arithmetic_exact(completions, answer=answer, **kwargs)


# Tools (operators/environments/environment.py, ToolEnvironment), as 'reward_fixtures:NAME'.
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
    columns = ("answer",)

    def reset(self, row):
        self.answer = row["answer"]

    def step(self, turn):
        from operators.environments.environment import EnvStep

        return EnvStep(observation="+1=", reward=0.25)


def flaky_calculator(expression):
    """The calculator, except that it raises on a '7' and returns a number (not a string) on a '5'."""
    from operators.environments.environment import calculator

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
    columns = ("answer",)

    def reset(self, row):
        self.kind = row["answer"]

    def step(self, turn):
        from operators.environments.environment import EnvStep

        return {"text": EnvStep(reward="high"), "nan": EnvStep(reward=float("nan")),
                "observation": EnvStep(observation=42, reward=1.0), "fine": EnvStep(observation="+1=", reward=0.5)
                }[self.kind]


# Sandbox escapes (tests/integration/test_sandbox.py): each does what the sandbox must contain.
def start_sleeper_and_hang(completions, **kwargs):
    """Starts a grandchild (`sleep`), says its pid on stderr ("sleeper pid N": a file would land in the
    sandbox's private /tmp under bubblewrap), then never answers."""
    import subprocess
    import sys
    import time

    sleeper = subprocess.Popen(["sleep", "1000"])
    print(f"sleeper pid {sleeper.pid}", file=sys.stderr, flush=True)
    while True:
        time.sleep(3600)


def sees_test_secret(completions, **kwargs):
    """1.0 when STREAMRL_TEST_SECRET is in the process's environment, or in the one it was started with."""
    import os

    with open("/proc/self/environ", "rb") as environ:
        initial = environ.read()
    found = "STREAMRL_TEST_SECRET" in os.environ or b"STREAMRL_TEST_SECRET=" in initial
    return [float(found)] * len(completions)


def allocate_two_gib(completions, **kwargs):
    """1.0 after allocating and touching 2 GiB."""
    block = bytearray(2 << 30)
    block[:: 1 << 20] = b"x" * len(block[:: 1 << 20])
    return [1.0] * len(completions)


def write_two_mib(completions, tmp_name, **kwargs):
    """1.0 after writing 2 MiB to the file named by the row's `tmp_name` in the temporary folder; says on
    stderr how many bytes the file holds either way (the parent cannot see the sandbox's private /tmp)."""
    import os
    import sys
    import tempfile

    path = os.path.join(tempfile.gettempdir(), tmp_name[0])
    try:
        with open(path, "wb") as out:
            out.write(b"x" * (2 << 20))
    finally:
        print(f"write_two_mib: {os.path.getsize(path)} bytes", file=sys.stderr, flush=True)
        os.remove(path)
    return [1.0] * len(completions)


def writes(completions, **kwargs):
    """Per completion, a file path: 1.0 when the process can create that file and write to it, else 0.0."""
    scores = []
    for path in completions:
        try:
            with open(path, "w") as out:
                out.write("escaped")
            scores.append(1.0)
        except OSError:
            scores.append(0.0)
    return scores


def connects(completions, port, **kwargs):
    """1.0 when a TCP connection to 127.0.0.1 at the row's `port` opens, else 0.0."""
    import socket

    try:
        socket.create_connection(("127.0.0.1", int(port[0])), timeout=10).close()
        reached = 1.0
    except OSError:
        reached = 0.0
    return [reached] * len(completions)


def network_interfaces(completions, **kwargs):
    """How many network interfaces the process sees besides loopback."""
    import socket

    return [float(sum(name != "lo" for _, name in socket.if_nameindex()))] * len(completions)


class _RunsOnUnpickle:
    """Pickles to `os.system(command)`: whoever unpickles it runs the command."""

    def __init__(self, command):
        self.command = command

    def __reduce__(self):
        import os

        return os.system, (self.command,)


def pickle_into_pipe(completions, marker, **kwargs):
    """Writes a pickle that creates the row's `marker` file when unpickled into the sandbox's pipe to
    its parent (found among the process's objects), then answers 1.0."""
    import gc
    from multiprocessing.connection import Connection

    for conn in [obj for obj in gc.get_objects() if isinstance(obj, Connection)]:
        conn.send(_RunsOnUnpickle(f"touch {marker[0]}"))
    return [1.0] * len(completions)


def huge_tool(arguments):
    """A 9 MiB result: over the sandbox's default reply cap."""
    return "x" * (9 << 20)


class _StrThatRunsOnUnpickle(str):
    def __reduce__(self):
        import os

        return os.system, (f"touch {self}",)


def unpickle_trap_tool(arguments):
    """A string (a subclass) whose pickle creates the file named by the arguments."""
    return _StrThatRunsOnUnpickle(arguments)


def needs_trainer_state(prompts, completions, trainer_state, **kwargs):
    """A TRL-style reward that requires TRL's `trainer_state`, which streamrl does not pass: it fits neither
    style."""
    return [float(trainer_state.global_step > 0)] * len(completions)


def always_raises(completions, **kwargs):
    """A reward function that fails on every sample (a judge that cannot be reached)."""
    raise ConnectionError("the judge at http://127.0.0.1:9 refused the connection")
