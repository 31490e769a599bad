"""A simulated rollout engine: a cost model of a continuous-batching inference server.

`SimEngine` implements both engine interfaces without a model: `RolloutEngine` (one call at
a time: `generate`, `load_weights`) and `InFlightEngine` (many requests streamed on a
`RolloutLoop`, pause/resume for weight updates). Its `model_path` is a JSON cost-model file
(see `CostModel`), so the rest of the DAG needs no new plumbing: the engines' factories take it by
its import path, `make_engine(ENGINE, "cost.json")` or `make_in_flight_engine(ENGINE, "cost.json")`
(ENGINE = "benchmarks.sim_engine:SimEngine", importable wherever the repository root is the
working directory, Ray's local workers included). It exists to run the real DAG (scheduler,
staleness gate, Ray Data backpressure, rollout loop, Train) at cluster scale on a CPU machine;
every figure it produces is a simulation. It is benchmark code: the package (operators/) does not
ship or name it.

What it models, per engine instance (`gpus_per_instance` accelerators; one engine stands for
`instances` of them, each new sequence going to the least loaded):

- decode runs in ticks; a tick advances every active sequence by one token and costs
  `decode_step_s + decode_per_seq_s * active` simulated seconds (memory-bound decode: a
  fixed cost to stream the weights, a small marginal cost per sequence);
- at most `max_num_seqs` sequences are active; the rest wait in FIFO order and join as
  others finish (continuous batching: a finished sequence frees its slot at once);
- response lengths are long-tailed (lognormal, capped), drawn per prompt (seeded by the
  prompt, so every schedule decodes the same workload);
- a weight update stalls decoding for `weight_sync_s`. Call-synchronous (`load_weights`):
  the server pauses for that long. In flight: `pause("keep")` freezes every active sequence
  at once, `pause("wait")` lets the sequences in flight finish (new ones are held), and the
  `weight_sync_s` stall is spent in `load_prepared` (the in-place load, as with vLLM);
  `resume()` goes on from where each sequence stood.

Simulated seconds become real sleeps divided by `time_scale`. The server is an event
simulation driven by the wall clock, in a thread of its own: it sleeps until the next
sequence finishes (or a request arrives) and advances every instance analytically, so a tick
of a few simulated milliseconds costs no Python work of its own. In flight, what it reports
reaches the rollout loop's event loop through `loop.call_soon_threadsafe`.

Token ids are fake: each id stands for `token_unit` simulated tokens (so Ray Data moves
small lists), log-probs are zeros, texts are empty. A streamed sequence delivers its ids
when it finishes, and, on `pause("keep")`, the ids it decoded so far (so the rollout loop
tags them with the version that sampled them); between pauses the version cannot change,
so nothing finer is needed. With `stats_dir` set, every engine appends its utilisation and
each weight update's stall to `stats_dir/engine-<pid>-<n>.jsonl` (benchmarks/simulate_cluster.py
reads them). This module does not import torch.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import json
import math
import os
import threading
import time
import zlib
from collections import deque
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import AsyncIterator

import numpy as np

from operators.engines.base import GroupSample, SamplingParams, TokenDelta

ENGINE = "benchmarks.sim_engine:SimEngine"  # what rollout.engine / make_engine take to run this simulator


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
    weight_sync_s: float = 3.0  # decoding stalled while new weights load
    length: LengthModel = field(default_factory=LengthModel)
    length_seed: int = 0
    train_seconds_per_token: float = 1.5e-4  # GPU-seconds per trained token
    train_step_fixed_s: float = 3.0  # optimizer step, gradient sync
    train_gpus: int = 1
    stats_dir: str | None = None  # not a cost: where engines record utilisation and update stalls

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

    def ids(self, tokens: int) -> int:
        """Fake ids of a response of `tokens` simulated tokens."""
        return math.ceil(tokens / self.token_unit)


class _Sequence:
    """One response: `length` simulated tokens; `sink.finish(self)` is called when it ends."""

    __slots__ = ("length", "sink", "sample", "start", "delivered")

    def __init__(self, length: int, sink, sample: int = 0):
        self.length = int(length)
        self.sink = sink
        self.sample = sample  # which of its request's n responses
        self.start = 0.0  # its instance's tick count when it got a slot
        self.delivered = 0  # fake ids handed out so far (pauses flush what was decoded)


class _Request:
    """A call-synchronous batch: done when all its sequences are."""

    def __init__(self, count: int):
        self.remaining = count
        self.done = threading.Event()
        if count == 0:
            self.done.set()

    def finish(self, sequence: _Sequence) -> None:
        self.remaining -= 1
        if self.remaining == 0:
            self.done.set()


class _Instance:
    """One engine instance: active sequences keyed by the virtual tick they finish at."""

    def __init__(self):
        self.ticks = 0.0  # decode ticks run so far (fractional between events)
        self.active: list[tuple[float, int, _Sequence]] = []  # heap of (finish tick, seq no, sequence)
        self.waiting: deque[_Sequence] = deque()

    def load(self) -> int:
        return len(self.active) + len(self.waiting)


class DecodeServer:
    """Continuous batching over `cost.instances` instances, driven by the wall clock.

    Thread-safe: callers submit sequences and pause from any thread; a daemon thread retires
    sequences as they finish and tells their sink (under the server's lock, so a sink must only
    record or hand off)."""

    def __init__(self, cost: CostModel):
        self.cost = cost
        self.instances = [_Instance() for _ in range(cost.instances)]
        self.version = 0
        self.cond = threading.Condition()
        self.last = time.monotonic()
        self.paused_until = 0.0  # call-synchronous weight load: nothing decodes until then
        self.frozen = False  # pause("keep"): nothing decodes until resume()
        self.holding = False  # paused: new sequences wait in `held` until resume()
        self.held: list[_Sequence] = []
        self.on_drained = None  # pause("wait"): called once nothing submitted before the pause is left
        self.closed = False
        self.sequence_numbers = itertools.count()
        # Utilisation, in real seconds (simulated = x time_scale): instance-seconds with a sequence active,
        # sequence-seconds active, simulated tokens decoded.
        self.busy_instance_seconds = 0.0
        self.active_sequence_seconds = 0.0
        self.decoded_tokens = 0.0
        self.thread = threading.Thread(target=self._loop, daemon=True, name="sim-decode")
        self.thread.start()

    # --- callers ---------------------------------------------------------------------

    def submit(self, sequences: list[_Sequence]) -> None:
        with self.cond:
            self._advance(time.monotonic())
            if self.holding:
                self.held.extend(sequences)
            else:
                self._place(sequences)
            self.cond.notify()

    def run(self, lengths: list[int]) -> None:
        """Decode sequences of the given lengths (simulated tokens); return when all are done."""
        request = _Request(len(lengths))
        self.submit([_Sequence(length, request) for length in lengths])
        request.done.wait()

    def load_weights(self, version: int | None) -> None:
        """Call-synchronous: pause decoding for the weight-sync cost (once per new version), wait it out."""
        with self.cond:
            now = time.monotonic()
            self._advance(now)
            if version is None or version > self.version:
                self.version = version if version is not None else self.version
                self.paused_until = max(now, self.paused_until) + self.cost.weight_sync_s / self.cost.time_scale
                self.cond.notify()
            until = self.paused_until
        time.sleep(max(0.0, until - time.monotonic()))

    def freeze(self) -> list[tuple[_Sequence, int]]:
        """pause("keep"): stop every instance now; each active sequence with the ids it decoded
        since it last delivered (to be flushed to its caller)."""
        with self.cond:
            self._advance(time.monotonic())
            self.frozen = self.holding = True
            flushed = []
            for instance in self.instances:
                for _, _, sequence in instance.active:
                    decoded = int((instance.ticks - sequence.start) // self.cost.token_unit)
                    if decoded > sequence.delivered:
                        flushed.append((sequence, decoded - sequence.delivered))
                        sequence.delivered = decoded
            return flushed

    def hold(self, on_drained) -> bool:
        """pause("wait"): new sequences are held; True if nothing is in flight now, else
        `on_drained()` is called (under the lock) once the last one finishes."""
        with self.cond:
            self._advance(time.monotonic())
            self.holding = True
            if not self.in_flight():
                return True
            self.on_drained = on_drained
            return False

    def resume(self) -> None:
        with self.cond:
            self._advance(time.monotonic())  # frozen: only moves the clock on
            self.frozen = self.holding = False
            self.on_drained = None
            held, self.held = self.held, []
            self._place(held)
            self.cond.notify()

    def drop(self, sequences: list[_Sequence]) -> None:
        """Forget sequences (their caller is gone): they free their slots now."""
        gone = {id(sequence) for sequence in sequences}
        with self.cond:
            self._advance(time.monotonic())
            for instance in self.instances:
                instance.active = [entry for entry in instance.active if id(entry[2]) not in gone]
                heapq.heapify(instance.active)
                instance.waiting = deque(s for s in instance.waiting if id(s) not in gone)
                self._admit(instance)
            self.held = [s for s in self.held if id(s) not in gone]
            self._check_drained()
            self.cond.notify()

    def in_flight(self) -> int:
        """Sequences submitted and not finished, held ones excluded."""
        return sum(instance.load() for instance in self.instances)

    def utilisation(self) -> dict:
        with self.cond:
            self._advance(time.monotonic())
            return {"instances": len(self.instances), "busy_instance_s": self.busy_instance_seconds,
                    "active_sequence_s": self.active_sequence_seconds, "decoded_tokens": self.decoded_tokens}

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify()
        self.thread.join(timeout=5)

    # --- the tick loop ---------------------------------------------------------------

    def _place(self, sequences: list[_Sequence]) -> None:
        for sequence in sequences:
            target = min(self.instances, key=_Instance.load)
            target.waiting.append(sequence)
            self._admit(target)

    def _admit(self, instance: _Instance) -> None:
        while instance.waiting and len(instance.active) < self.cost.max_num_seqs:
            sequence = instance.waiting.popleft()
            sequence.start = instance.ticks
            heapq.heappush(instance.active, (instance.ticks + sequence.length, next(self.sequence_numbers), sequence))

    def _tick_real(self, instance: _Instance) -> float:
        return self.cost.tick_seconds(len(instance.active)) / self.cost.time_scale

    def _advance(self, now: float) -> None:
        """Run every instance from `self.last` to `now`, retiring finished sequences."""
        start = max(self.last, self.paused_until)
        self.last = now
        if self.frozen or now <= start:
            return
        for instance in self.instances:
            elapsed = now - start
            while instance.active and elapsed > 0:
                tick = self._tick_real(instance)
                active = len(instance.active)
                to_next = max(instance.active[0][0] - instance.ticks, 0.0)  # ticks until the next sequence ends
                ran = to_next if tick <= 0 else min(to_next, elapsed / tick)  # zero cost: all due at once
                instance.ticks += ran
                self.busy_instance_seconds += ran * tick
                self.active_sequence_seconds += ran * tick * active
                self.decoded_tokens += ran * active
                elapsed -= ran * tick
                if ran < to_next:
                    break
                instance.ticks = max(instance.ticks, instance.active[0][0])
                while instance.active and instance.active[0][0] <= instance.ticks + 1e-9:
                    _, _, sequence = heapq.heappop(instance.active)
                    sequence.sink.finish(sequence)
                self._admit(instance)
        self._check_drained()

    def _check_drained(self) -> None:
        if self.on_drained is not None and not self.in_flight():
            callback, self.on_drained = self.on_drained, None
            callback()

    def _next_event_in(self, now: float) -> float | None:
        if self.frozen:
            return None
        if now < self.paused_until:
            return self.paused_until - now
        waits = [
            (instance.active[0][0] - instance.ticks) * self._tick_real(instance)
            for instance in self.instances if instance.active
        ]
        return max(min(waits), 0.0) if waits else None

    def _loop(self) -> None:
        with self.cond:
            while not self.closed:
                now = time.monotonic()
                self._advance(now)
                self.cond.wait(self._next_event_in(now))


class _Stream:
    """The sequences of one streamed request and the queue that takes their deltas to the event loop."""

    def __init__(self, engine: SimEngine, lengths: np.ndarray):
        self.engine = engine
        self.queue: asyncio.Queue = asyncio.Queue()
        self.sequences = [_Sequence(length, self, sample) for sample, length in enumerate(lengths)]
        self.open = True

    def finish(self, sequence: _Sequence) -> None:
        """Server side (any thread, under the server's lock): hand the rest of its ids to the loop."""
        ids = self.engine.cost.ids(sequence.length) - sequence.delivered
        sequence.delivered += ids
        self.engine.loop.call_soon_threadsafe(self.put, TokenDelta(sequence.sample, [0] * ids, [0.0] * ids, True))

    def put(self, delta: TokenDelta | None) -> None:
        """On the loop."""
        if self.open:
            self.queue.put_nowait(delta)
            self.engine._queued(+1)

    def close(self) -> None:
        """On the loop: nothing more is read from this stream."""
        self.open = False
        self.engine._queued(-self.queue.qsize())


class SimEngine:
    """The cost model as a `RolloutEngine` (call-synchronous) and as an `InFlightEngine`."""

    can_pause = True
    _numbers = itertools.count()

    def __init__(self, model_path: str, **options):
        # options (torch_threads, trust_remote_code, ...) belong to real engines; nothing to set here
        self.cost = CostModel.load(model_path)
        self.server = DecodeServer(self.cost)
        self.loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[str, _Stream] = {}
        self._undelivered = 0  # deltas queued on the loop and not yet taken by their stream
        self._all_taken: asyncio.Event | None = None
        self._pause: dict | None = None  # the update in progress
        self._stats_path = None
        if self.cost.stats_dir is not None:
            self._stats_path = Path(self.cost.stats_dir) / f"engine-{os.getpid()}-{next(self._numbers)}.jsonl"
            self._stats_path.parent.mkdir(parents=True, exist_ok=True)
            self._record({"event": "start"})

    # --- shared by both interfaces ------------------------------------------------------

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

    # --- RolloutEngine: one call at a time ----------------------------------------------

    def generate(self, prompt_token_ids: list[list[int]], params: SamplingParams) -> list[GroupSample]:
        lengths = self.draw_lengths(prompt_token_ids, params.n)
        self.server.run([int(x) for group in lengths for x in group])
        groups = []
        for group in lengths:
            ids = [[0] * self.cost.ids(int(length)) for length in group]
            groups.append(GroupSample(token_ids=ids, logprobs=[[0.0] * len(t) for t in ids], texts=[""] * len(ids)))
        return groups

    def load_weights(self, state_dict: Mapping[str, np.ndarray]) -> None:
        start = time.perf_counter()
        version = int(state_dict["version"]) if "version" in state_dict else None
        self.server.load_weights(version)
        self._record({"event": "update", "version": version, "mode": "call", "pause_s": time.perf_counter() - start})

    # --- InFlightEngine: on the rollout loop --------------------------------------------

    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._all_taken = asyncio.Event()
        self._all_taken.set()

    def decode(self, token_ids: list[int]) -> str:
        return ""

    async def stream(
        self, prompt_token_ids: list[int], params: SamplingParams, seed: int, request_id: str, cache_salt: str
    ) -> AsyncIterator[TokenDelta]:
        # seed and cache_salt change nothing: lengths follow the prompt, and there is no KV cache to salt
        stream = _Stream(self, self.draw_lengths([prompt_token_ids], params.n)[0])
        self._streams[request_id] = stream
        self.server.submit(stream.sequences)
        unfinished = len(stream.sequences)
        try:
            while unfinished:
                delta = await stream.queue.get()
                self._queued(-1)
                if delta is None:  # aborted
                    return
                unfinished -= delta.finished
                yield delta
        finally:
            self._streams.pop(request_id, None)
            stream.close()
            if unfinished:
                self.server.drop(stream.sequences)

    def prepare_weights(self, state_dict: Mapping[str, np.ndarray]) -> int | None:
        # the simulated trainer publishes {"version": v}: nothing to stage, the load's cost is load_prepared's
        return int(state_dict["version"]) if "version" in state_dict else None

    async def pause(self, mode: str) -> None:
        if mode not in ("keep", "wait"):
            raise ValueError(f"pause mode {mode!r}: use 'keep' or 'wait'")
        self._pause = {"mode": mode, "start": time.perf_counter(), "in_flight": self.server.in_flight()}
        if mode == "keep":
            for sequence, ids in self.server.freeze():  # what each froze with goes out under the old version
                sequence.sink.put(TokenDelta(sequence.sample, [0] * ids, [0.0] * ids, False))
        else:
            drained = asyncio.Event()
            if not self.server.hold(lambda: self.loop.call_soon_threadsafe(drained.set)):
                await drained.wait()
        self._pause["drain_s"] = time.perf_counter() - self._pause["start"]
        # Every delta posted before now is on the loop's ready queue ahead of this task's next step
        # (call_soon_threadsafe is FIFO); wait until the streams have taken them, i.e. the rollout loop
        # has tagged them with the version they were sampled under.
        await asyncio.sleep(0)
        await self._all_taken.wait()

    async def load_prepared(self, prepared: int | None) -> None:
        await asyncio.sleep(self.cost.weight_sync_s / self.cost.time_scale)  # the in-place load: the stall
        if prepared is not None:
            self.server.version = prepared
        if self._pause is not None:
            self._pause["version"] = prepared

    async def resume(self) -> None:
        self.server.resume()
        update, self._pause = self._pause, None
        if update is not None:
            start = update.pop("start")
            self._record({"event": "update", **update, "pause_s": time.perf_counter() - start})

    async def abort(self, request_id: str) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            self.server.drop(stream.sequences)
            stream.put(None)

    async def shutdown(self) -> None:
        self._record({"event": "shutdown"})
        self.server.close()

    # --- internals ---------------------------------------------------------------------

    def _queued(self, change: int) -> None:
        """Deltas on the loop not yet taken by a stream (on the loop thread only)."""
        self._undelivered += change
        if self._undelivered:
            self._all_taken.clear()
        else:
            self._all_taken.set()

    def _record(self, entry: dict) -> None:
        if self._stats_path is None:
            return
        entry = {"t": time.time(), **entry, **self.server.utilisation()}
        with self._stats_path.open("a") as out:
            out.write(json.dumps(entry) + "\n")
