"""Environments for multi-turn rollouts: what answers the model between its turns.

An environment is a class with two methods, named in the config like a reward function
(`rollout.environment.name`: a builtin name or 'package.module:Class', built with
`rollout.environment.options` as keyword arguments, one instance per episode):

    class Guess:
        stop = ("?",)                          # strings that end a model turn (besides EOS)
        columns = ("answer",)                  # the dataset columns reset reads (checked before a job starts)
        def reset(self, row: dict) -> None:    # the dataset row of the episode's prompt
            self.secret = int(row["answer"])
        def step(self, turn: Turn) -> EnvStep:  # the model's turn: text and token ids
            guess = int(turn.text.rstrip("?") or -1)
            if guess == self.secret:
                return EnvStep(reward=1.0, done=True)
            return EnvStep(observation="higher" if guess < self.secret else "lower")

The rollout (operators/engines/episodes.py, `RolloutLoop.submit_episodes`) runs each episode: a model
turn (one request to the in-flight engine, ended by EOS, a stop string or the turn's token
limit), then `step` (in a worker thread, so a slow environment never holds the engine), the
observation's tokens appended to the context, and again, until `done`, a turn that ends with
EOS, `max_turns` or the episode's token budget. Observation tokens are the environment's, not
the policy's: they carry no loss (`loss_masks`). An environment that raises ends its episode
with the error recorded (counted as `env_errors`); the job goes on.

Tools are the builtin environment "tools" (`ToolEnvironment`): plain Python functions, called
when the model's turn ends with a call in the declared format, in a sandbox child process with a
per-call timeout (operators/environments/sandbox.py, as reward functions). A tool that raises, hangs or does
not return a string gives an error observation (counted as `tool_errors`), never a dead job.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import math
import threading
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

import numpy as np

from operators.algorithms.registry import Registry

ENVIRONMENTS = Registry("environment")
TOOLS = Registry("tool")


@dataclass
class Turn:
    """One model turn of an episode, as the environment sees it."""

    index: int  # 0 for the first turn
    text: str  # decoded (special tokens skipped)
    token_ids: list[int]
    ended_by: str  # "stop" (a stop string), "eos", or "length" (the turn's token limit)
    history: str = ""  # everything after the prompt before this turn (turns and observations)


@dataclass
class EnvStep:
    """What the environment answers to a turn."""

    observation: str = ""  # appended to the context (as the environment's tokens) before the next turn
    reward: float | None = None  # added to the episode's reward (per-turn rewards are recorded too)
    done: bool = False
    tool_call: str | None = None  # for lineage: the call the turn made, if any
    error: str | None = None  # the turn caused an error (a failed tool call); the observation says so
    info: dict = field(default_factory=dict)


def env_step_problem(result) -> str | None:
    """What is wrong with an environment's answer to a turn, or None: it must be an EnvStep whose reward is
    None or a finite number, whose observation is text, and whose tool_call and error are None or text.
    The rollout loop treats a wrong answer as the environment's error (that episode ends, counted in
    env_errors), not as the job's: a NaN reward would otherwise make the whole step's loss NaN."""
    if not isinstance(result, EnvStep):
        return f"step() returned {type(result).__name__}, not an EnvStep"
    reward = result.reward
    if reward is not None:
        if isinstance(reward, bool) or not isinstance(reward, (int, float, np.integer, np.floating)):
            return f"EnvStep.reward is {type(reward).__name__} {reward!r}, not a number"
        if not math.isfinite(float(reward)):
            return f"EnvStep.reward is {float(reward)}, not a finite number"
    if not isinstance(result.observation, str):
        return f"EnvStep.observation is {type(result.observation).__name__}, not text"
    for name in ("tool_call", "error"):
        value = getattr(result, name)
        if value is not None and not isinstance(value, str):
            return f"EnvStep.{name} is {type(value).__name__}, not text or None"
    return None


class Environment(Protocol):
    stop: Sequence[str]
    columns: Sequence[str]  # optional: the dataset columns `reset` reads, which every dataset of a job must have

    def reset(self, row: dict) -> None:
        """Start an episode for this dataset row (its columns, e.g. `answer`)."""

    def step(self, turn: Turn) -> EnvStep:
        """Answer the model's turn."""


def import_named(name: str, kind: str):
    """`module:attribute` imported (an environment, a tool, an agent); raises naming the fix."""
    module_name, _, attribute = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ImportError(f"cannot import module {module_name!r} of {kind} {name!r} ({err}); make it importable "
                          "(installed, or on PYTHONPATH) or use a builtin name") from None
    value = getattr(module, attribute, None)
    if value is None:
        raise AttributeError(f"module {module_name!r} has no attribute {attribute!r}; check the {kind}'s name")
    return value


def resolve_environment(name: str) -> type:
    """A builtin environment by name, or 'module:Class'. Raises with the fix in the message."""
    cls = ENVIRONMENTS.get(name) if ":" not in name else import_named(name, "environment")
    missing = [method for method in ("reset", "step") if not callable(getattr(cls, method, None))]
    if missing:
        raise TypeError(f"environment {name!r} has no {' or '.join(missing)} method; an environment is a class "
                        "with reset(row) and step(turn) -> EnvStep (operators/environments/environment.py)")
    return cls


def resolve_tool(name: str) -> Callable[..., str]:
    """A builtin tool by name, or 'module:function'."""
    fn = TOOLS.get(name) if ":" not in name else import_named(name, "tool")
    if not callable(fn):
        raise TypeError(f"tool {name!r} is not callable; a tool is a function returning a string")
    return fn


class EnvironmentFactory:
    """Makes one environment per episode: `resolve_environment(name)(**options)`. Picklable (it travels
    to the Generate actors with their arguments); the class is resolved in the process that uses it.

    It owns what its episodes share: the sandbox pools of their tool calls (`SandboxPools`), handed to an
    environment class whose constructor takes `sandbox_pools` (ToolEnvironment does), so one Generate
    actor's episodes share its sandbox processes; `close()` (the Generate operator's) stops them."""

    def __init__(self, name: str, options: dict | None = None):
        self.name, self.options = name, dict(options or {})
        self._cls = None
        self.sandbox_pools = SandboxPools()

    def __getstate__(self):
        return {"name": self.name, "options": self.options}

    def __setstate__(self, state):
        self.__init__(state["name"], state["options"])

    def __call__(self) -> Environment:
        if self._cls is None:
            self._cls = resolve_environment(self.name)
        if "sandbox_pools" in inspect.signature(self._cls).parameters:
            return self._cls(**self.options, sandbox_pools=self.sandbox_pools)
        return self._cls(**self.options)

    def close(self) -> None:
        self.sandbox_pools.close()


# --- tools ----------------------------------------------------------------------------------------

class SandboxPool:
    """`size` sandbox children for one tool set (operators/environments/sandbox.py, Sandbox of kind "tool"), each
    started on its first call, reused, and replaced after a call that timed out: up to `size` tool calls
    run at once (episodes wait for a free child), so one slow call never holds every episode."""

    def __init__(self, tools: Sequence[str], size: int, limits=None):
        import queue

        from operators.environments.sandbox import Sandbox, SandboxLimits

        self.sandboxes = [Sandbox(list(tools), "tool", limits or SandboxLimits()) for _ in range(size)]
        self._free: queue.Queue = queue.Queue()
        for sandbox in self.sandboxes:
            self._free.put(sandbox)

    def call(self, tool: str, arguments: str, timeout_s: float) -> tuple[str | None, str | None]:
        sandbox = self._free.get()
        try:
            result, problem = sandbox.call(tool, [arguments], {}, timeout_s)
        finally:
            self._free.put(sandbox)
        if problem is None and not isinstance(result, str):  # sandbox_tool_result sends strings only
            return None, "the sandbox's reply is not a string"
        return result, problem

    def close(self) -> None:
        for sandbox in self.sandboxes:
            sandbox.close()


class SandboxPools:
    """The sandbox pools of one owner (an EnvironmentFactory, shared by its episodes; or a ToolEnvironment
    made without one), one per tool set, size and limits, made on first use; stopped by `close()`."""

    def __init__(self):
        self._pools: dict[tuple, SandboxPool] = {}
        self._lock = threading.Lock()  # episodes' tool calls run in several threads at once

    def get(self, tools: Sequence[str], size: int = 4, limits=None) -> SandboxPool:
        """The pool for these tools (and limits: an operators.environments.sandbox.SandboxLimits)."""
        key = (tuple(tools), int(size), limits)
        with self._lock:
            if key not in self._pools:
                self._pools[key] = SandboxPool(key[0], key[1], limits)
            return self._pools[key]

    def close(self) -> None:
        with self._lock:
            pools, self._pools = list(self._pools.values()), {}
        for pool in pools:
            pool.close()


class ToolEnvironment:
    """The builtin environment "tools": a turn that ends with `call_start` ... `call_end` calls a tool;
    its result comes back as the observation `result_start` result `result_end`, and the model goes on.
    A turn without a call ends the episode (it is the answer). The call's text is `name: arguments`
    (`separator`), or only the arguments when one tool is declared; the arguments reach the tool as one
    string. Each call runs in a sandbox child process, killed after `timeout_s` (0: in this process, no
    limit); a failure becomes the observation `result_start` "error: <what went wrong>" `result_end`
    (only "error" with `error_detail` False, for a vocabulary that cannot spell the details).
    `max_result_chars` cuts a long result. `sandboxes`: sandbox processes per generate actor, shared by
    its episodes (tool calls that run at once). `limits`: what each sandbox child may use
    (operators.environments.sandbox.SandboxLimits; a job passes its `sandbox` config's). `sandbox_pools`: where the
    sandboxes come from (the EnvironmentFactory's, shared by the actor's episodes); without it, the
    environment makes its own on its first call and stops them on `close()`."""

    def __init__(self, tools: Sequence[str] = ("calculator",), call_start: str = "[", call_end: str = "]",
                 result_start: str = "{", result_end: str = "}", separator: str = ":", timeout_s: float = 5.0,
                 max_result_chars: int = 200, error_detail: bool = True, sandboxes: int = 4, limits=None,
                 sandbox_pools: SandboxPools | None = None):
        self.limits = limits
        self.sandbox_pools = sandbox_pools
        self._owns_pools = sandbox_pools is None
        if not tools:
            raise ValueError("tools: name at least one tool (a builtin such as 'calculator', or 'module:function')")
        if not call_start or not call_end:
            raise ValueError("call_start and call_end must be non-empty strings")
        self.tools = [str(tool) for tool in tools]
        self.call_start, self.call_end = call_start, call_end
        self.result_start, self.result_end = result_start, result_end
        self.separator, self.timeout_s, self.max_result_chars = separator, float(timeout_s), int(max_result_chars)
        self.error_detail = bool(error_detail)  # False: a failed call reads "error" (a tiny vocabulary)
        if int(sandboxes) < 1:
            raise ValueError("sandboxes: at least 1 (sandbox processes per generate actor: tool calls at once)")
        self.sandboxes = int(sandboxes)
        self.stop = (call_end,)

    @staticmethod
    def config_problems(options: dict) -> list[str]:
        """What config validation reports about these options (before any actor starts): tools that
        cannot be imported."""
        problems = []
        for tool in options.get("tools", ("calculator",)):
            try:
                resolve_tool(str(tool))
            except (KeyError, ImportError, AttributeError, TypeError) as err:
                problems.append(f"tools: {str(err).strip(chr(34) + chr(39))}")
        return problems

    def reset(self, row: dict) -> None:
        pass

    def parse(self, text: str) -> tuple[str, str] | None:
        """(tool name, arguments) of the call the turn ends with, or None when it makes none."""
        if not text.endswith(self.call_end) or self.call_start not in text:
            return None
        body = text[text.rindex(self.call_start) + len(self.call_start): len(text) - len(self.call_end)]
        if len(self.tools) == 1 and (not self.separator or self.separator not in body
                                     or body.split(self.separator, 1)[0].strip() != _short(self.tools[0])):
            return self.tools[0], body
        name, _, arguments = body.partition(self.separator)
        name = name.strip()
        for tool in self.tools:
            if name in (tool, _short(tool)):
                return tool, arguments.strip()
        return name, arguments

    def call(self, tool: str, arguments: str) -> tuple[str | None, str | None]:
        """(result, None) or (None, what went wrong)."""
        if tool not in self.tools:
            return None, f"unknown tool {tool!r}; tools: {', '.join(_short(t) for t in self.tools)}"
        if self.timeout_s <= 0:
            try:
                result = resolve_tool(tool)(arguments)
            except Exception as err:  # noqa: BLE001 - the model's call failed, not the job
                return None, f"{type(err).__name__}: {err}"
            if not isinstance(result, str):
                return None, f"TypeError: tool {tool!r} returned {type(result).__name__}, not a string"
            return result, None
        if self.sandbox_pools is None:
            self.sandbox_pools = SandboxPools()
        pool = self.sandbox_pools.get(self.tools, self.sandboxes, self.limits)
        result, problem = pool.call(tool, arguments, self.timeout_s)
        if problem == "timeout":
            return None, f"timeout: no answer within {self.timeout_s:g}s"
        return (result, None) if problem is None else (None, problem)

    def step(self, turn: Turn) -> EnvStep:
        call = self.parse(turn.text)
        if call is None:
            return EnvStep(done=True)
        tool, arguments = call
        result, error = self.call(tool, arguments)
        text = result if error is None else f"error: {error}" if self.error_detail else "error"
        text = text[: self.max_result_chars]
        return EnvStep(observation=f"{self.result_start}{text}{self.result_end}", tool_call=f"{tool}({arguments})",
                       error=error)

    def close(self) -> None:
        """Stop the sandboxes this environment made for itself (not those of a factory it was given)."""
        if self._owns_pools and self.sandbox_pools is not None:
            self.sandbox_pools.close()


def sandbox_tool_result(fn: Callable[..., str], args: list, kwargs: dict) -> str:
    """A tool's result in the sandbox child (operators/environments/sandbox.py); it must be a string."""
    result = fn(*args, **kwargs)
    if not isinstance(result, str):
        raise TypeError(f"tool {getattr(fn, '__name__', fn)!r} returned {type(result).__name__}, not a string")
    return result


def _short(tool: str) -> str:
    """A tool's name as the model writes it: 'calculator' for 'calculator' and for 'pkg.mod:calculator'."""
    return tool.rpartition(":")[2]


ENVIRONMENTS.register("tools")(ToolEnvironment)

MAX_EXPRESSION_CHARS = 200
MAX_MAGNITUDE = 10**12

_BINARY = {ast.Add: lambda x, y: x + y, ast.Sub: lambda x, y: x - y, ast.Mult: lambda x, y: x * y}
_UNARY = {ast.USub: lambda x: -x, ast.UAdd: lambda x: x}


@TOOLS.register("calculator")
def calculator(expression: str) -> str:
    """The value of an integer expression of ``+``, ``-``, ``*`` and parentheses, as a string.

    Parsed with ``ast`` and walked node by node (never ``eval``): anything else (names,
    calls, ``**``, ``/``, floats, strings) raises ``ValueError``, and so does an expression over
    ``MAX_EXPRESSION_CHARS`` characters or any value, intermediate ones included, over
    ``MAX_MAGNITUDE`` in size, so a model's call cannot make the tool slow or huge.
    """
    if not isinstance(expression, str):
        raise ValueError(f"expression must be a string, not {type(expression).__name__}")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as err:
        raise ValueError(f"not an expression: {expression!r} ({type(err).__name__})") from None

    def value(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:  # bool is not an int here
            out = node.value
        elif isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            out = _BINARY[type(node.op)](value(node.left), value(node.right))
        elif isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            out = _UNARY[type(node.op)](value(node.operand))
        else:
            raise ValueError(f"unsupported in a calculator expression: {type(node).__name__}")
        if abs(out) > MAX_MAGNITUDE:
            raise ValueError(f"a value over {MAX_MAGNITUDE} in size")
        return out

    try:
        return str(value(tree.body))
    except RecursionError:
        raise ValueError("expression nested too deeply") from None
