"""A simulated rollout engine: a cost model of a continuous-batching inference server.

`SimEngine` implements both engine interfaces without a model: `RolloutEngine` (one call at
a time: `generate`, `load_weights`) and `InFlightEngine` (many requests streamed on a
`RolloutLoop`, pause/resume for weight updates). Its `model_path` is a JSON cost-model file
(see `CostModel`, benchmarks/sim_cost.py), so the rest of the DAG needs no new plumbing: the engines'
factories take it by its import path, `make_engine(ENGINE, "cost.json")` or
`make_in_flight_engine(ENGINE, "cost.json")` (ENGINE = "benchmarks.sim_engine:SimEngine", importable
wherever the project is installed, `pip install -e .`, Ray's local workers included). The decode
server it drives is benchmarks/sim_server.py. It exists to run the real DAG (scheduler,
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
import itertools
import json
import math
import os
import time
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import AsyncIterator

import numpy as np

from benchmarks.sim_cost import CostModel
from benchmarks.sim_server import DecodeServer, Sequence
from operators.engines.base import GroupSample, SamplingParams, TokenDelta

ENGINE = "benchmarks.sim_engine:SimEngine"  # what rollout.engine / make_engine take to run this simulator


class _Stream:
    """The sequences of one streamed request and the queue that takes their deltas to the event loop."""

    def __init__(self, engine: SimEngine, lengths: np.ndarray):
        self.engine = engine
        self.queue: asyncio.Queue = asyncio.Queue()
        self.sequences = [Sequence(length, self, sample) for sample, length in enumerate(lengths)]
        self.open = True

    def finish(self, sequence: Sequence) -> None:
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
