"""What the rollout loop and its multi-turn episodes share about one engine, as one object both hold.

`EngineSlots` keeps the cap on sequences in flight (a sample that finishes frees its slot at once), the
policy version loaded now (every token records it), the log of update pauses (a group's results say how
long it sat through them), the request ids, and the count of episodes running, which a swap without
partial rollout waits on (no new episode starts until it has). The rollout loop (operators/engines/
rollout.py) makes it and runs the swaps; the episode runner (operators/engines/episodes.py) takes slots
for its turns. Everything here runs on the rollout loop's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools


class EngineSlots:
    def __init__(self, cap: int, version: int):
        self.cap = int(cap)
        self.version = version  # the policy version the engine holds now
        self.in_flight = 0  # sequences in the engine (or waiting for its resume)
        self.peak_in_flight = 0
        self.tokens_received = 0
        self.episodes_active = 0  # multi-turn episodes started and not ended
        self._ids = itertools.count()
        self._pauses: list[tuple[float, float]] = []  # (start, end) wall clock of each stall
        self._changed = asyncio.Condition()
        self._version_event = asyncio.Event()
        self._holding_episodes = False  # a swap waits for the running episodes; new ones wait for it

    def request_id(self, uid: str) -> str:
        return f"{uid}-{next(self._ids)}"

    def received(self, count: int) -> int:
        """Count `count` tokens that arrived; the version that sampled them."""
        self.tokens_received += count
        return self.version

    # --- slots -------------------------------------------------------------------------------

    async def acquire(self, count: int) -> None:
        async with self._changed:
            await self._changed.wait_for(lambda: self.in_flight == 0 or self.in_flight + count <= self.cap)
            self.in_flight += count
            self.peak_in_flight = max(self.peak_in_flight, self.in_flight)

    async def release(self, count: int) -> None:
        async with self._changed:
            self.in_flight -= count
            self._changed.notify_all()

    async def wait_empty(self) -> None:
        """Until nothing is in flight."""
        async with self._changed:
            await self._changed.wait_for(lambda: self.in_flight == 0)

    # --- episodes ------------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def episode(self):
        """One episode running (it waits while a swap holds new episodes back)."""
        async with self._changed:
            await self._changed.wait_for(lambda: not self._holding_episodes)
            self.episodes_active += 1
        try:
            yield
        finally:
            async with self._changed:
                self.episodes_active -= 1
                self._changed.notify_all()

    async def drain_episodes(self) -> None:
        """Hold new episodes back until the running ones have ended (every episode from one version)."""
        if not self.episodes_active:
            return
        async with self._changed:
            self._holding_episodes = True
            try:
                await self._changed.wait_for(lambda: self.episodes_active == 0)
            finally:
                self._holding_episodes = False
                self._changed.notify_all()

    # --- versions and pauses ------------------------------------------------------------------

    def set_version(self, version: int) -> None:
        """Synchronous on purpose: no delta is handled between this and the engine's resume()."""
        self.version = version
        event, self._version_event = self._version_event, asyncio.Event()
        event.set()

    async def wait_version(self, min_version: int, check=None) -> int:
        """Until the engine holds a version >= min_version (`check()` raises a failure on each wake)."""
        while self.version < min_version:
            if check is not None:
                check()
            await self._version_event.wait()
        return self.version

    def record_pause(self, start_wall: float, seconds: float) -> None:
        self._pauses.append((start_wall, start_wall + seconds))
        del self._pauses[:-64]

    def paused_within(self, start: float, end: float) -> float:
        """Seconds of update pauses between wall-clock `start` and `end`."""
        return sum(max(0.0, min(e, end) - max(s, start)) for s, e in self._pauses)
