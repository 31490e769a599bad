"""The in-flight rollout loop: many requests on one engine, fed from several Generate calls at once.

`RolloutLoop` owns an `InFlightEngine` (operators/engines/base.py; vLLM's AsyncLLM, the simulator)
on an asyncio event loop of its own, in a daemon thread of the process that made it. Generate calls
run in other threads of the same actor (Ray Data gives the Generate actor several calls at once);
each submits its prompt groups here and gets every group back the moment its `n` samples are done.

    loop = RolloutLoop(engine, max_seqs_in_flight=256, partial_rollout=True, store=store_handle)
    loop.wait_version(step - max_staleness)            # the staleness gate, on the weights *loaded*
    for future in loop.submit(prompts, params, seeds, uids): ...   # concurrent.futures, any order

- **Cap.** At most `max_seqs_in_flight` sequences are in the engine at once; a sample that
  finishes frees its slot at once, so the next group starts while its group-mates still decode.
- **Weight updates.** With a policy store, a watcher waits for each new version, pulls the
  weights from the object store and prepares them (e.g. writes the engine's load file) while
  decoding goes on; only then does it pause the engine, load in place and resume. With
  `partial_rollout=True` the pause keeps the requests in flight ("keep"): they go on with the
  new weights. With `False` every response comes from one version, in one of two ways
  (`update_when`): "drain" pauses at once and lets the requests in flight finish ("wait"; new ones
  wait), so the engine's batch empties through the longest tail; "idle" keeps decoding with the
  old weights, new admissible requests included, and swaps when nothing is in flight (the
  staleness gate bounds how long: groups that need the new version are not admitted).
- **Versions per token.** Every token records the policy version loaded when it arrived
  (`GroupResult.token_versions`); the engine's contract guarantees that tokens sampled before a
  pause are delivered before `resume()`, and the version changes only just before `resume()`.
  A group's staleness is that of its oldest token.
- **Update log.** Each update's `UpdateRecord` (the version, the pull and prepare seconds,
  overlapped with decoding, and the pause: the only stall, pause/drain + load + resume) goes to the
  store's load log (`record_load`); `load_policy` returns it.
- **Multi-turn.** `submit_episodes` runs episodes against an environment, turn by turn
  (operators/engines/episodes.py, mixed into the loop); what the loop hands back and reports is in
  operators/engines/rollout_records.py.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import threading
import time
import uuid
from typing import Any, Mapping

import numpy as np

from operators.engines.base import GroupSample, InFlightEngine, SamplingParams
from operators.engines.episodes import MultiTurnEpisodes
from operators.engines.rollout_records import GroupResult, UpdateRecord
from operators.faults import FaultPoints
from operators.weights import received_async

logger = logging.getLogger(__name__)

# The watcher asks the store for the next version in polls this long, never in one call pending until it comes:
# Ray ends an actor whose handles were dropped (Ray Data's, when its input runs out) only after the calls it made
# return, so a call pending for the next version kept the actor from closing its engine (pipelines/runtime/
# policy_store.py `poll_version`).
WATCH_POLL_S = 1.0


class RolloutLoop(MultiTurnEpisodes):
    def __init__(
        self,
        engine: InFlightEngine,
        *,
        max_seqs_in_flight: int = 256,
        partial_rollout: bool = False,
        store=None,
        initial_version: int = 0,
        name: str = "",
        update_when: str = "drain",
        faults: FaultPoints = FaultPoints(),
    ):
        """`faults`: the fault points armed for a test or a chaos run (operators/faults.py; none by default)."""
        if partial_rollout and not getattr(engine, "can_pause", False):
            raise ValueError(f"{type(engine).__name__} cannot pause requests in flight: partial rollout needs one that can")
        self.engine = engine
        self.cap = int(max_seqs_in_flight)
        self.partial_rollout = partial_rollout
        if update_when not in ("drain", "idle"):
            raise ValueError(f"update_when: {update_when!r}; use 'drain' or 'idle'")
        self.update_when = update_when
        self.store = store
        self.faults = faults
        self.name = name  # reported with each update to the store (its load log)
        self.version = initial_version
        self.in_flight = 0  # sequences in the engine (or waiting for its resume)
        self.peak_in_flight = 0
        self.tokens_received = 0
        self._ids = itertools.count()
        self._failure: BaseException | None = None
        # Environments' steps (tool calls) run here, not on the loop: many episodes wait on tools at once.
        self._env_executor = concurrent.futures.ThreadPoolExecutor(max_workers=64, thread_name_prefix="rollout-env")
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="rollout-loop")
        self._thread.start()
        self._run(self._setup()).result()
        if store is not None:
            self._watcher = asyncio.run_coroutine_threadsafe(self._watch(), self._loop)

    # --- called from other threads (Generate calls) ----------------------------------------------

    def submit(
        self, prompt_token_ids: list[list[int]], params: SamplingParams, seeds: list[int], uids: list[str]
    ) -> list[concurrent.futures.Future]:
        """Start one group per prompt; each future resolves to its GroupResult as soon as it is done."""
        self._raise_failure()
        return [self._run(self._group(list(ids), params, seed, uid))
                for ids, seed, uid in zip(prompt_token_ids, seeds, uids)]

    def wait_version(self, min_version: int, timeout_s: float | None = None) -> int:
        """Block until the engine has loaded a version >= min_version; the loaded version."""
        future = self._run(self._wait_version(min_version))
        try:
            return future.result(timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(
                f"no policy version >= {min_version} was loaded within {timeout_s}s (loaded: {self.version})"
            ) from None

    def load_policy(self, version: int, state_dict: Mapping[str, np.ndarray]) -> UpdateRecord:
        """Load `version` now (no store: an evaluator, a test), with the same pause as the watcher."""
        start = time.perf_counter()
        prepared = self.engine.prepare_weights(state_dict)
        return self._run(self._swap(version, prepared, pull_s=0.0, prepare_s=time.perf_counter() - start)).result()

    def close(self) -> None:
        if self._loop.is_closed():
            return
        try:
            self._run(self._shutdown()).result(timeout=60)
        except Exception:  # best effort: the engine's processes also die with this one
            logger.exception("rollout engine shutdown failed")
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._env_executor.shutdown(wait=False, cancel_futures=True)

    # --- on the loop -------------------------------------------------------------------------------

    def _run(self, coroutine) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop)

    def _raise_failure(self) -> None:
        if self._failure is not None:
            raise RuntimeError(f"the rollout loop's weight watcher failed: {self._failure!r}") from self._failure

    async def _setup(self) -> None:
        self._slots = asyncio.Condition()
        self._version_event = asyncio.Event()
        self._swap_lock = asyncio.Lock()
        self._pauses: list[tuple[float, float]] = []  # (start, end) wall clock of each stall
        self.episodes_active = 0  # multi-turn episodes started and not ended
        self._swap_waiting = False  # without partial rollout: a swap waits for the episodes to end
        await self.engine.start()
        if self.store is not None and getattr(self.engine, "weight_transfer", None):
            await self.engine.join_weight_plane(self.store, f"{self.name}:{uuid.uuid4().hex[:8]}", self.faults)

    async def _shutdown(self) -> None:
        watcher = getattr(self, "_watcher", None)
        if watcher is not None:
            watcher.cancel()
        if getattr(self.engine, "engine_id", None) and self.store is not None:
            try:  # leave the plane first, so the trainer's sender stops sending here
                await asyncio.wait_for(self.store.unregister_engine.remote(self.engine.engine_id), 10)
            except Exception:  # the store is gone with its job: nothing to leave
                pass
        await self.engine.shutdown()

    async def _acquire(self, count: int) -> None:
        async with self._slots:
            await self._slots.wait_for(lambda: self.in_flight == 0 or self.in_flight + count <= self.cap)
            self.in_flight += count
            self.peak_in_flight = max(self.peak_in_flight, self.in_flight)

    async def _release(self, count: int) -> None:
        async with self._slots:
            self.in_flight -= count
            self._slots.notify_all()

    async def _group(self, prompt_ids: list[int], params: SamplingParams, seed: int, uid: str) -> GroupResult:
        if self._failure is not None:
            self._raise_failure()
        n = params.n
        held = min(n, self.cap)  # a group larger than the cap runs alone
        await self._acquire(held)
        start = time.time()
        tokens: list[list[int]] = [[] for _ in range(n)]
        logprobs: list[list[float]] = [[] for _ in range(n)]
        versions: list[list[int]] = [[] for _ in range(n)]
        request_id = f"{uid}-{next(self._ids)}"
        try:
            async for delta in self.engine.stream(prompt_ids, params, seed, request_id, f"policy-v{self.version}"):
                version = self.version
                self.tokens_received += len(delta.token_ids)
                tokens[delta.sample].extend(delta.token_ids)
                logprobs[delta.sample].extend(delta.logprobs)
                versions[delta.sample].extend([version] * len(delta.token_ids))
                if delta.finished and held:
                    held -= 1  # its slot is free for the next group at once
                    await self._release(1)
        finally:
            if held:
                await self._release(held)
        end = time.time()
        texts = [self.engine.decode(ids) for ids in tokens]
        paused = sum(max(0.0, min(e, end) - max(s, start)) for s, e in self._pauses)
        return GroupResult(GroupSample(tokens, logprobs, texts), versions, start, end, paused)

    async def _wait_version(self, min_version: int) -> int:
        while self.version < min_version:
            self._raise_failure()
            await self._version_event.wait()
        return self.version

    def _set_version(self, version: int) -> None:
        """Synchronous on purpose: no delta is handled between this and the engine's resume()."""
        self.version = version
        event, self._version_event = self._version_event, asyncio.Event()
        event.set()

    async def _swap(self, version: int, prepared: Any, pull_s: float, prepare_s: float) -> UpdateRecord:
        async with self._swap_lock:
            if not self.partial_rollout and self.update_when == "idle":
                async with self._slots:  # decode on with the old weights until nothing is in flight
                    await self._slots.wait_for(lambda: self.in_flight == 0)
            waited = time.perf_counter()
            if not self.partial_rollout and self.episodes_active:
                # every episode from one version: no new episode starts, those running end (all their
                # turns) with the old weights; in "idle" mode too, as an episode waiting for its tool holds
                # no engine slot
                async with self._slots:
                    self._swap_waiting = True
                    try:
                        await self._slots.wait_for(lambda: self.episodes_active == 0)
                    finally:
                        self._swap_waiting = False
                        self._slots.notify_all()
            in_flight, start_wall, start = self.in_flight, time.time(), time.perf_counter()
            await self.engine.pause("keep" if self.partial_rollout else "wait")
            if self.in_flight:  # tests and chaos runs: die here, with requests frozen in the engine
                self.faults.reach("rollout_paused", version=version, in_flight=self.in_flight)
            paused = time.perf_counter()
            applied = await self.engine.load_prepared(prepared)
            loaded = time.perf_counter()
            if applied:  # the weight plane: the version the engine confirmed (a newer one may have arrived)
                version = applied["version"]
            self._set_version(version)
            await self.engine.resume()
            end = time.perf_counter()
            self._pauses.append((start_wall, start_wall + end - start))
            del self._pauses[:-64]
            record = UpdateRecord(version, pull_s, prepare_s, paused - start, loaded - paused, end - start, in_flight,
                                  episode_wait_s=start - waited, verified=bool(applied and applied["verified"]),
                                  checked=int(applied["checked"]) if applied else 0)
            return record

    async def _watch(self) -> None:
        """Load every newer version the store publishes (skipping ones already replaced)."""
        loop = asyncio.get_running_loop()
        plane = getattr(self.engine, "engine_id", None)
        try:
            while plane:  # the weight plane: the bytes are already here, staged by the engine's receivers
                version = await self.store.wait_delivered.remote(plane, self.version + 1, WATCH_POLL_S)
                if version is None:  # short polls: no call stays pending when the actor is asked to exit
                    continue
                record = await self._swap(version, int(version), pull_s=0.0, prepare_s=0.0)
                self.store.record_load.remote(self.name, dict(vars(record)))  # no reply awaited
            while True:
                if await self.store.poll_version.remote(self.version + 1, WATCH_POLL_S) is None:
                    continue
                start = time.perf_counter()
                version, (weights_ref,) = await self.store.get_latest.remote()
                if version <= self.version or weights_ref is None:
                    continue
                weights = await received_async(await weights_ref)  # the manifest, then its buckets
                pulled = time.perf_counter()
                prepared = await loop.run_in_executor(None, self.engine.prepare_weights, weights)
                del weights
                record = await self._swap(version, prepared, pulled - start, time.perf_counter() - pulled)
                self.store.record_load.remote(self.name, dict(vars(record)))  # no reply awaited
        except asyncio.CancelledError:
            raise
        except BaseException as err:  # surfaced to every caller: a generator without weights must not go on
            self._failure = err
            self._set_version(self.version)  # wake waiters so they see it
            logger.exception("rollout weight watcher failed")


def wait_all(futures: list[concurrent.futures.Future]) -> list[GroupResult]:
    """Results in submission order (cancels the rest if one fails)."""
    try:
        return [future.result() for future in futures]
    except BaseException:
        for future in futures:
            future.cancel()
        raise
