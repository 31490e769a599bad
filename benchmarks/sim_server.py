"""The simulated engine's decode server: continuous batching over engine instances, by the wall clock.

`DecodeServer` is what `SimEngine` (benchmarks/sim_engine.py, whose docstring says what is modelled)
drives: sequences wait for a slot, decode in ticks priced by the cost model (benchmarks/sim_cost.py),
and tell their sink when they finish; weight loads stall it, pauses freeze or drain it.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections import deque

from benchmarks.sim_cost import CostModel


class Sequence:
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

    def finish(self, sequence: Sequence) -> None:
        self.remaining -= 1
        if self.remaining == 0:
            self.done.set()


class _Instance:
    """One engine instance: active sequences keyed by the virtual tick they finish at."""

    def __init__(self):
        self.ticks = 0.0  # decode ticks run so far (fractional between events)
        self.active: list[tuple[float, int, Sequence]] = []  # heap of (finish tick, seq no, sequence)
        self.waiting: deque[Sequence] = deque()

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
        self.held: list[Sequence] = []
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

    def submit(self, sequences: list[Sequence]) -> None:
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
        self.submit([Sequence(length, request) for length in lengths])
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

    def freeze(self) -> list[tuple[Sequence, int]]:
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

    def drop(self, sequences: list[Sequence]) -> None:
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

    def _place(self, sequences: list[Sequence]) -> None:
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
