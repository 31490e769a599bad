"""The interface every generation engine implements, so `Generate` does not care which runs (which class
runs an engine name: operators/engines/factory.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Mapping, Protocol

import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 decodes greedily (log-probs are then of the untempered distribution)."""

    n: int = 8
    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0
    min_new_tokens: int = 0  # no EOS before this many tokens (benchmarks and tests of long decodes)


@dataclass
class GroupSample:
    """The `n` responses of one prompt. Log-probs are of the sampled tokens under the
    sampling distribution (temperature applied), one per response token."""

    token_ids: list[list[int]] = field(default_factory=list)
    logprobs: list[list[float]] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)


class RolloutEngine(Protocol):
    def generate(self, prompt_token_ids: list[list[int]], params: SamplingParams) -> list[GroupSample]:
        """One GroupSample per prompt, each with `params.n` responses."""

    def load_weights(self, state_dict: Mapping[str, np.ndarray]) -> None:
        """Replace the policy weights in place (names as in the HF state dict)."""

    def encode(self, prompts: list[str]) -> list[list[int]]:
        """Prompt token ids (with BOS where the tokenizer adds it)."""


# --- in-flight engines ---------------------------------------------------------------------------
# An engine with many requests in flight (vLLM's AsyncLLM, the simulator's decode server) is driven by a
# `RolloutLoop` (operators/engines/rollout.py) on one asyncio event loop of its own: the loop owns the engine,
# feeds it from several Generate calls at once, tags every token with the policy version loaded when
# the token arrived, and swaps weights with pause -> load -> resume.


@dataclass
class TokenDelta:
    """New tokens of one of a request's `n` samples, as the engine streams them."""

    sample: int  # which of the n responses (0..n-1)
    token_ids: list[int]
    logprobs: list[float]  # one per token, as in GroupSample
    finished: bool = False
    # an engine that serves each version as a LoRA adapter: the version of the adapter this request runs on
    # from start to end (None: the tokens are the version loaded when they arrive)
    version: int | None = None


class InFlightEngine(Protocol):
    """Every coroutine runs on the RolloutLoop's event loop; `prepare_weights` runs in a worker thread.

    Contract for partial rollout (`can_pause`): after `pause("keep")` returns, the engine samples no token
    until `resume()`; every token sampled before the pause has been (or, while paused, is still being)
    delivered by `stream`, never after `resume()` is called. `pause("wait")` returns once every request
    in flight has finished (new requests are held, not started, until `resume()`)."""

    can_pause: bool

    async def start(self) -> None:
        """Create the engine on the running loop (once, before anything else)."""

    def encode(self, prompts: list[str]) -> list[list[int]]:
        """Prompt token ids, as RolloutEngine.encode."""

    def decode(self, token_ids: list[int]) -> str:
        """A response's text (special tokens skipped)."""

    def encode_text(self, text: str) -> list[int]:
        """Token ids of text that continues a sequence, no BOS (an environment's observation; only
        engines that run multi-turn episodes need it)."""

    def stream(
        self, prompt_token_ids: list[int], params: SamplingParams, seed: int, request_id: str, cache_salt: str
    ) -> AsyncIterator[TokenDelta]:
        """Sample `params.n` responses to one prompt; yields deltas until every sample has finished.
        `cache_salt` changes with the policy version so no KV block of older weights is reused by a new
        request (in-flight requests keep theirs)."""

    def prepare_weights(self, state_dict: Mapping[str, np.ndarray]) -> Any:
        """Get the weights ready to load (e.g. write them where the engine's workers read them) while
        decoding continues; returns what `load_prepared` takes."""

    async def pause(self, mode: str) -> None:
        """'keep': freeze requests in flight; 'wait': let them finish. New requests wait for resume()."""

    async def load_prepared(self, prepared: Any) -> None:
        """Replace the weights in place (while paused)."""

    async def resume(self) -> None:
        """Continue: frozen requests go on with the new weights; held requests start."""

    async def abort(self, request_id: str) -> None:
        """Drop a request in flight (its caller is gone)."""

    async def shutdown(self) -> None:
        """Stop the engine's processes."""
