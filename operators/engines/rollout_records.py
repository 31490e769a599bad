"""What the in-flight rollout loop (operators/engines/rollout.py) hands back and reports: a prompt group's
responses with the policy version of every token (`GroupResult`), a multi-turn response's turns
(`Episode`), and one weight update's timings (`UpdateRecord`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from operators.engines.base import GroupSample


@dataclass
class GroupResult:
    """One prompt's `n` responses, with the policy version of every response token."""

    sample: GroupSample
    token_versions: list[list[int]]
    start: float  # wall clock: submitted to the engine (after the caller's admission)
    end: float  # wall clock: the last sample finished
    pause_s: float = 0.0  # weight-update pauses while this group was in flight
    episodes: list | None = None  # multi-turn: one Episode per response (operators/environments/environment.py)
    # agent episodes (operators/engines/agent_episodes.py): the prompt the responses continue, when it is not the
    # row's rendered prompt (the agent wrote its own messages)
    prompt_ids: list[int] | None = None
    version: int = 0  # the engine's version when the group ended: its version when no response has a token

    @property
    def version_min(self) -> int:
        return min((min(v) for v in self.token_versions if v), default=self.version)

    @property
    def version_max(self) -> int:
        return max((max(v) for v in self.token_versions if v), default=self.version)


@dataclass
class Episode:
    """One multi-turn response: its turns and what ended it. `loss_mask` has one entry per response
    token: 1 for the policy's tokens, 0 for the environment's (observations)."""

    loss_mask: list[int]
    turns: list[dict]  # per turn: text, tool_call, observation, reward, error, ended_by, tokens, version
    end: str  # "done" (the environment), "eos", "max_turns", "token_budget" or "env_error"
    reward: float = 0.0  # the environment's rewards, summed
    tool_calls: int = 0
    tool_errors: int = 0
    env_errors: int = 0


@dataclass
class UpdateRecord:
    version: int
    pull_s: float  # object store -> this process (decoding goes on)
    prepare_s: float  # e.g. writing the engine's load file (decoding goes on)
    drain_s: float  # pause(): "keep" freezes at once, "wait" lets the requests in flight finish
    load_s: float  # in-place load (paused)
    pause_s: float  # the whole stall: drain + load + resume
    in_flight: int  # sequences in the engine when the update began
    at: float = field(default_factory=time.time)
    # without partial rollout: how long the update waited for multi-turn episodes in flight to end (the
    # engine went on decoding them; new episodes waited), before its pause
    episode_wait_s: float = 0.0
    verified: bool = False  # the weight plane: checksums compared with the trainer's on this update
    checked: int = 0  # tensors whose checksums were compared (received and applied)
    probe_gap: float | None = None  # the served-policy probe's mean gap from the trainer's (None: not probed)
