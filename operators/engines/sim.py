"""A simulated rollout engine: a cost model of a continuous-batching inference server.

`SimEngine` implements the `RolloutEngine` interface without a model. Its `model_path`
is a JSON cost-model file (see `CostModel`), so the rest of the DAG needs no new plumbing:
`make_engine("sim", "cost.json")`. It exists to run the real DAG (scheduler, staleness
gate, Ray Data backpressure, Train) at cluster scale on a CPU machine; every figure it
produces is a simulation.

What it models, per engine instance (`gpus_per_instance` accelerators):

- decode runs in ticks; a tick advances every active sequence by one token and costs
  `decode_step_s + decode_per_seq_s * active` simulated seconds (memory-bound decode: a
  fixed cost to stream the weights, a small marginal cost per sequence);
- at most `max_num_seqs` sequences are active; the rest wait in FIFO order and join as
  others finish (continuous batching: a finished sequence frees its slot at once);
- response lengths are long-tailed (lognormal, capped), drawn per sequence;
- a weight update pauses decoding for `weight_sync_s`.

Simulated seconds become real sleeps divided by `time_scale`. The server is an event
simulation driven by the wall clock: it sleeps until the next sequence finishes (or a new
request arrives) and advances every instance analytically, so a tick of a few simulated
milliseconds costs no Python work of its own.

A call returns when all its sequences are done. One `DecodeServer` serves every call made
to it, concurrent ones included, through one tick loop: with one call in flight (what
`Generate` does today, `max_tasks_in_flight_per_actor=1`) an instance idles through its
call's tail; with several callers (`server_pool`: Generate actors as clients of shared
`SimServer` actors) the next call's sequences fill the slots the tail frees. Which of the
two a run used is recorded with its results.

Token ids are fake: each id stands for `token_unit` simulated tokens (so Ray Data moves
small lists), log-probs are zeros. This module does not import torch.
"""

from __future__ import annotations

import heapq
import itertools
import json
import math
import threading
import time
import zlib
from collections import deque
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from operators.engines.base import GroupSample, SamplingParams


@dataclass(frozen=True)
class LengthModel:
    """Response lengths in simulated tokens: lognormal(log(median), sigma), capped at `cap`."""

    median: float = 1000.0
    sigma: float = 1.0
    cap: int = 16384

    def draw(self, rng: np.random.Generator, size: int) -> np.ndarray:
        lengths = np.ceil(rng.lognormal(math.log(self.median), self.sigma, size))
        return np.clip(lengths, 1, self.cap).astype(np.int64)


@dataclass(frozen=True)
class CostModel:
    """Every parameter of the simulated engine (and of the simulated trainer, `train_*`)."""

    time_scale: float = 100.0  # simulated seconds per real second
    token_unit: int = 64  # simulated tokens per fake token id
    prompt_tokens: int = 256  # simulated prompt length (enters the trainer's token count)
    gpus_per_instance: int = 1
    instances: int = 1  # engine instances this actor stands for
    decode_step_s: float = 0.020  # per tick, independent of the batch
    decode_per_seq_s: float = 6e-5  # per tick, per active sequence
    max_num_seqs: int = 256  # active sequences per instance
    weight_sync_s: float = 3.0  # decoding paused while new weights load
    length: LengthModel = field(default_factory=LengthModel)
    length_seed: int = 0
    server_pool: str | None = None  # name of a SimServerPool actor; None: an in-process server
    train_seconds_per_token: float = 1.5e-4  # GPU-seconds per trained token
    train_step_fixed_s: float = 3.0  # optimizer step, gradient sync
    train_gpus: int = 1

    @classmethod
    def from_dict(cls, values: Mapping) -> CostModel:
        values = dict(values)
        values["length"] = LengthModel(**values.get("length", {}))
        unknown = set(values) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown cost-model fields {sorted(unknown)}; known: {sorted(cls.__dataclass_fields__)}")
        return cls(**values)

    @classmethod
    def load(cls, path: str | Path) -> CostModel:
        return cls.from_dict(json.loads(Path(path).read_text()))

    def to_dict(self) -> dict:
        return asdict(self)

    def tick_seconds(self, active: int) -> float:
        """Simulated seconds of one decode tick with `active` sequences."""
        return self.decode_step_s + self.decode_per_seq_s * active


class _Request:
    def __init__(self, count: int):
        self.remaining = count
        self.done = threading.Event()
        if count == 0:
            self.done.set()


class _Instance:
    """One engine instance: active sequences keyed by the virtual tick they finish at."""

    def __init__(self):
        self.ticks = 0.0  # decode ticks run so far (fractional between events)
        self.active: list[tuple[float, int, _Request]] = []  # heap of (finish tick, seq no, request)
        self.waiting: deque[tuple[int, _Request]] = deque()

    def load(self) -> int:
        return len(self.active) + len(self.waiting)


class DecodeServer:
    """Continuous batching over `cost.instances` instances, driven by the wall clock."""

    def __init__(self, cost: CostModel):
        self.cost = cost
        self.instances = [_Instance() for _ in range(cost.instances)]
        self.version = 0
        self.cond = threading.Condition()
        self.last = time.monotonic()
        self.paused_until = 0.0
        self.sequence_numbers = itertools.count()
        self.busy_seconds = 0.0  # real seconds with at least one sequence active
        self.thread = threading.Thread(target=self._loop, daemon=True, name="sim-decode")
        self.thread.start()

    # --- callers ---------------------------------------------------------------------

    def run(self, lengths: list[int]) -> None:
        """Decode sequences of the given lengths (simulated tokens); return when all are done."""
        request = _Request(len(lengths))
        with self.cond:
            self._advance(time.monotonic())
            for length in lengths:
                target = min(self.instances, key=_Instance.load)
                target.waiting.append((int(length), request))
                self._admit(target)
            self.cond.notify()
        request.done.wait()

    def load_weights(self, version: int | None) -> None:
        """Pause decoding for the weight-sync cost (once per new version), and wait it out."""
        with self.cond:
            now = time.monotonic()
            self._advance(now)
            if version is None or version > self.version:
                self.version = version if version is not None else self.version
                self.paused_until = max(now, self.paused_until) + self.cost.weight_sync_s / self.cost.time_scale
                self.cond.notify()
            until = self.paused_until
        time.sleep(max(0.0, until - time.monotonic()))

    # --- the tick loop ---------------------------------------------------------------

    def _admit(self, instance: _Instance) -> None:
        while instance.waiting and len(instance.active) < self.cost.max_num_seqs:
            length, request = instance.waiting.popleft()
            heapq.heappush(instance.active, (instance.ticks + length, next(self.sequence_numbers), request))

    def _tick_real(self, instance: _Instance) -> float:
        return self.cost.tick_seconds(len(instance.active)) / self.cost.time_scale

    def _advance(self, now: float) -> None:
        """Run every instance from `self.last` to `now`, retiring finished sequences."""
        start = max(self.last, self.paused_until)
        self.last = now
        if now <= start:
            return
        if any(instance.active for instance in self.instances):
            self.busy_seconds += now - start
        for instance in self.instances:
            elapsed = now - start
            while instance.active and elapsed > 0:
                tick = self._tick_real(instance)
                to_next = instance.active[0][0] - instance.ticks  # ticks until the next sequence ends
                if to_next * tick > elapsed:
                    instance.ticks += elapsed / tick
                    break
                elapsed -= max(to_next, 0.0) * tick
                instance.ticks = max(instance.ticks, instance.active[0][0])
                while instance.active and instance.active[0][0] <= instance.ticks + 1e-9:
                    _, _, request = heapq.heappop(instance.active)
                    request.remaining -= 1
                    if request.remaining == 0:
                        request.done.set()
                self._admit(instance)

    def _next_event_in(self, now: float) -> float | None:
        if now < self.paused_until:
            return self.paused_until - now
        waits = [
            (instance.active[0][0] - instance.ticks) * self._tick_real(instance)
            for instance in self.instances if instance.active
        ]
        return max(min(waits), 0.0) if waits else None

    def _loop(self) -> None:
        with self.cond:
            while True:
                now = time.monotonic()
                self._advance(now)
                self.cond.wait(self._next_event_in(now))


class SimEngine:
    """`RolloutEngine` over a `DecodeServer`: in this process, or a shared `SimServer` actor."""

    def __init__(self, model_path: str, **options):
        # options (torch_threads, trust_remote_code, ...) belong to real engines; nothing to set here
        self.cost = CostModel.load(model_path)
        if self.cost.server_pool is None:
            self.server, self.remote = DecodeServer(self.cost), None
        else:
            import ray

            pool = ray.get_actor(self.cost.server_pool)
            self.server, self.remote = None, ray.get(pool.assign.remote())

    def encode(self, prompts: list[str]) -> list[list[int]]:
        # The fake ids carry the prompt's hash: lengths are drawn per prompt, so two schedules
        # (or two policy versions) of the same prompts decode the same workload.
        ids = math.ceil(self.cost.prompt_tokens / self.cost.token_unit)
        return [[zlib.crc32(prompt.encode()) % 2**31] * ids for prompt in prompts]

    def draw_lengths(self, prompt_token_ids: list[list[int]], n: int) -> list[np.ndarray]:
        """Simulated response lengths, `n` per prompt, seeded by the prompt and `length_seed`."""
        return [
            self.cost.length.draw(np.random.default_rng([self.cost.length_seed, ids[0] if ids else 0]), n)
            for ids in prompt_token_ids
        ]

    def generate(self, prompt_token_ids: list[list[int]], params: SamplingParams) -> list[GroupSample]:
        lengths = self.draw_lengths(prompt_token_ids, params.n)
        flat = [int(x) for group in lengths for x in group]
        if self.remote is None:
            self.server.run(flat)
        else:
            import ray

            ray.get(self.remote.run.remote(flat))
        unit = self.cost.token_unit
        groups = []
        for group in lengths:
            ids = [[0] * math.ceil(int(length) / unit) for length in group]
            groups.append(GroupSample(token_ids=ids, logprobs=[[0.0] * len(t) for t in ids], texts=[""] * len(ids)))
        return groups

    def load_weights(self, state_dict: Mapping[str, np.ndarray]) -> None:
        version = int(state_dict["version"]) if "version" in state_dict else None
        if self.remote is None:
            self.server.load_weights(version)
        else:
            import ray

            ray.get(self.remote.load_weights.remote(version))


class SimServer:
    """A `DecodeServer` as a threaded Ray actor, shared by several `SimEngine` clients.
    Create with `ray.remote(SimServer).options(max_concurrency=..., resources=...)`."""

    def __init__(self, cost: dict):
        self.server = DecodeServer(CostModel.from_dict(cost))

    def run(self, lengths: list[int]) -> None:
        self.server.run(lengths)

    def load_weights(self, version: int | None) -> None:
        self.server.load_weights(version)

    def busy_seconds(self) -> float:
        return self.server.busy_seconds


class SimServerPool:
    """Hands `SimServer` handles to `SimEngine` clients round-robin (a named Ray actor)."""

    def __init__(self, servers: list):
        self.servers = servers
        self.next = 0

    def assign(self):
        server = self.servers[self.next % len(self.servers)]
        self.next += 1
        return server
