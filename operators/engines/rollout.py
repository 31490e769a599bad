"""The in-flight rollout loop: many requests on one engine, fed from several Generate calls at once.

`RolloutLoop` owns an `InFlightEngine` (operators/engines/base.py; vLLM's AsyncLLM, the simulator)
on an asyncio event loop of its own, in a daemon thread of the process that made it. Generate calls
run in other threads of the same actor (Ray Data gives the Generate actor several calls at once);
each submits its prompt groups here and gets every group back the moment its `n` samples are done.

    loop = RolloutLoop(engine, max_seqs_in_flight=256, partial_rollout=True, store=store_client)
    loop.wait_version(step - max_staleness)            # the staleness gate, on the weights *loaded*
    for future in loop.submit(prompts, params, seeds, uids): ...   # concurrent.futures, any order

- **Cap.** At most `max_seqs_in_flight` sequences are in the engine at once; a sample that
  finishes frees its slot at once, so the next group starts while its group-mates still decode.
- **Weight updates.** With a policy store, a watcher asks the plane's receiver (operators/weights/
  plane.py: the object store's, or the gloo plane's when the engine receives on it) for each new
  version; the receiver pulls it, or the engine's workers have already staged it, and the watcher
  prepares it (e.g. writes the engine's load file) while decoding goes on; only then does it pause
  the engine, load in place and resume. With
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
- **Multi-turn.** `submit_episodes` runs episodes against an environment, turn by turn, through
  the loop's episode runner (operators/engines/episodes.py). The loop and the runner share the
  engine's slots, version and pause log as one object (operators/engines/engine_slots.py); what
  the loop hands back and reports is in operators/engines/rollout_records.py.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from typing import Awaitable, Callable, Mapping

import numpy as np

from operators.engines.base import GroupSample, InFlightEngine, SamplingParams
from operators.engines.engine_slots import EngineSlots
from operators.engines.episodes import EpisodeRunner
from operators.engines.rollout_records import GroupResult, UpdateRecord
from operators.common.faults import FaultPoints
from operators.weights.checksums import differ, file_mismatches
from operators.weights.plane import Incoming, WeightMismatch
from operators.weights.planes import receiver_for
from operators.weights.probe import check_served

logger = logging.getLogger(__name__)

# The watcher asks the plane for the next version in polls this long, never in one call pending until it comes
# (operators/weights/store.py, PolicyStoreClient.poll_version_async, says why).
WATCH_POLL_S = 1.0


class RolloutLoop:
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
        """`store`: a PolicyStoreClient (operators/weights/store.py), or None (versions are loaded with
        `load_policy` only). `faults`: the fault points armed for a test or a chaos run (operators/common/faults.py;
        none by default)."""
        if partial_rollout and not getattr(engine, "can_pause", False):
            raise ValueError(f"{type(engine).__name__} cannot pause requests in flight: partial rollout needs one that can")
        self.engine = engine
        self.partial_rollout = partial_rollout
        if update_when not in ("drain", "idle"):
            raise ValueError(f"update_when: {update_when!r}; use 'drain' or 'idle'")
        self.update_when = update_when
        self.store = store
        self.receiver = receiver_for(store, engine) if store is not None else None
        self.faults = faults
        self.name = name  # reported with each update to the store (its load log)
        self.slots = EngineSlots(max_seqs_in_flight, initial_version)
        self._failure: BaseException | None = None
        # Environments' steps (tool calls) run here, not on the loop: many episodes wait on tools at once.
        self._env_executor = concurrent.futures.ThreadPoolExecutor(max_workers=64, thread_name_prefix="rollout-env")
        self.episodes = EpisodeRunner(engine, self.slots, self._env_executor, self._raise_failure)
        self._swap_lock: asyncio.Lock | None = None
        self._watcher: concurrent.futures.Future | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="rollout-loop")
        self._thread.start()
        self._run(self._setup()).result()
        if self.receiver is not None:
            self._watcher = self._run(self._watch())

    # The engine's state, for callers and tests (the slots own it).
    @property
    def version(self) -> int:
        return self.slots.version

    @property
    def peak_in_flight(self) -> int:
        return self.slots.peak_in_flight

    @property
    def tokens_received(self) -> int:
        return self.slots.tokens_received

    # --- called from other threads (Generate calls) ----------------------------------------------

    def submit(
        self, prompt_token_ids: list[list[int]], params: SamplingParams, seeds: list[int], uids: list[str]
    ) -> list[concurrent.futures.Future]:
        """Start one group per prompt; each future resolves to its GroupResult as soon as it is done."""
        self._raise_failure()
        return [self._run(self._group(list(ids), params, seed, uid))
                for ids, seed, uid in zip(prompt_token_ids, seeds, uids)]

    def submit_episodes(
        self, prompt_token_ids: list[list[int]], params: SamplingParams, seeds: list[int], uids: list[str],
        make_env, rows: list[dict], max_turns: int, max_tokens: int,
    ) -> list[concurrent.futures.Future]:
        """Start `params.n` multi-turn episodes per prompt (operators/engines/episodes.py EpisodeRunner.group
        says what each does); each future resolves to a GroupResult whose `episodes` say what happened."""
        self._raise_failure()
        return [self._run(self.episodes.group(list(ids), params, seed, uid, make_env, row, max_turns, max_tokens))
                for ids, seed, uid, row in zip(prompt_token_ids, seeds, uids, rows)]

    def check_failure(self) -> None:
        """Raise the loop's failure (its weight watcher's), if it has one."""
        self._raise_failure()

    def run_on_loop(self, coroutine) -> concurrent.futures.Future:
        """Run `coroutine` on the loop's event loop (a server that samples with `sample_async`, e.g. the
        OpenAI-compatible endpoint, operators/engines/openai_endpoint.py)."""
        return self._run(coroutine)

    async def sample_async(self, prompt_ids: list[int], params: SamplingParams, seed: int, uid: str) -> GroupResult:
        """On the loop: one group, as `submit` starts it (the loop's admission, slots and weight updates)."""
        return await self._group(list(prompt_ids), params, seed, uid)

    def wait_version(self, min_version: int, timeout_s: float | None = None) -> int:
        """The staleness gate: block until the engine has loaded a version >= min_version; the loaded version."""
        future = self._run(self.slots.wait_version(min_version, self._raise_failure))
        try:
            return future.result(timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(
                f"no policy version >= {min_version} was loaded within {timeout_s}s (loaded: {self.version})"
            ) from None

    def load_policy(self, version: int, state_dict: Mapping[str, np.ndarray],
                    digests: dict[str, str] | None = None) -> UpdateRecord:
        """Load `version` now (no store: an evaluator, a test), with the same pause as the watcher; with the
        trainer's `digests`, the file written for the engine is checked against them."""
        return self._run(self._load(Incoming(version, state_dict, digests=digests))).result()

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
        self._swap_lock = asyncio.Lock()
        await self.engine.start()
        if self.receiver is not None:
            await self.receiver.join_async(self.name, self.faults)

    async def _shutdown(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
        if self.receiver is not None:
            try:
                await asyncio.wait_for(self.receiver.leave_async(), 10)
            except Exception:  # the store is gone with its job: nothing to leave
                pass
        await self.engine.shutdown()

    async def _group(self, prompt_ids: list[int], params: SamplingParams, seed: int, uid: str) -> GroupResult:
        self._raise_failure()
        slots, n = self.slots, params.n
        held = min(n, slots.cap)  # a group larger than the cap runs alone
        await slots.acquire(held)
        start = time.time()
        tokens: list[list[int]] = [[] for _ in range(n)]
        logprobs: list[list[float]] = [[] for _ in range(n)]
        versions: list[list[int]] = [[] for _ in range(n)]
        request_id = slots.request_id(uid)
        try:
            async for delta in self.engine.stream(prompt_ids, params, seed, request_id, f"policy-v{slots.version}"):
                version = slots.received(len(delta.token_ids))
                version = version if delta.version is None else delta.version  # an adapter: the request's own
                tokens[delta.sample].extend(delta.token_ids)
                logprobs[delta.sample].extend(delta.logprobs)
                versions[delta.sample].extend([version] * len(delta.token_ids))
                if delta.finished and held:
                    held -= 1  # its slot is free for the next group at once
                    await slots.release(1)
        finally:
            if held:
                await slots.release(held)
        end = time.time()
        texts = [self.engine.decode(ids) for ids in tokens]
        return GroupResult(GroupSample(tokens, logprobs, texts), versions, start, end, slots.paused_within(start, end))

    async def _load(self, incoming: Incoming) -> UpdateRecord:
        """Load one version: prepare it while decoding goes on (a file for vLLM), then swap. A version the
        engine's workers staged (the gloo plane) needs no preparing: the engine applies it in the pause. An
        engine that serves versions as LoRA adapters adds it with no pause at all."""
        if getattr(self.engine, "serves_adapters", False):
            return await self._add_adapter(incoming)
        if incoming.staged:
            return await self._swap(incoming.version, lambda: self.engine.apply_received(incoming.version),
                                    incoming.pull_s, 0.0)
        start = time.perf_counter()
        prepared, checked = await asyncio.get_running_loop().run_in_executor(
            None, self._prepare_checked, self.engine.prepare_weights, incoming)
        incoming.weights = None  # the engine's copy is all that is kept
        prepare_s = time.perf_counter() - start
        record = await self._swap(incoming.version, lambda: self.engine.load_prepared(prepared), incoming.pull_s,
                                  prepare_s)
        if incoming.digests:  # the object-store plane's verified version: pulled bytes and written file checked
            record.verified, record.checked = True, checked
        return record

    def _prepare_checked(self, prepare: Callable, incoming: Incoming, *first) -> tuple[object, int]:
        """`prepare(*first, weights)` (runs beside decoding); on a verified version the file it wrote for the
        engine to load (full weights, or a LoRA adapter's folder) is checked against the trainer's digests.
        (what prepare returned, the tensors checked: received and written)."""
        prepared = prepare(*first, incoming.weights)
        if not incoming.digests or not isinstance(prepared, str):
            return prepared, incoming.checked
        checked, bad = file_mismatches(prepared, incoming.digests)
        if bad:
            raise WeightMismatch(
                f"engine {self.name}: policy version {incoming.version} as written for the engine to load "
                f"({prepared}) does not match the trainer's checksums: {differ(bad)}. The attempt stops rather "
                "than sample from weights nobody trained")
        return prepared, incoming.checked + checked

    async def _add_adapter(self, incoming: Incoming) -> UpdateRecord:
        """A version as a LoRA adapter: written and added while decoding goes on; requests in flight finish on
        the adapter they started with (their tokens say so: TokenDelta.version), new ones take this one. The
        engine's adapter and the loop's version change together, with no await between them."""
        start = time.perf_counter()
        prepared, checked = await asyncio.get_running_loop().run_in_executor(
            None, self._prepare_checked, self.engine.prepare_adapter, incoming, incoming.version)
        incoming.weights = None
        prepared_at = time.perf_counter()
        async with self._swap_lock:
            if self.faults.fires("engine_ignores_update", version=incoming.version):
                self.slots.set_version(incoming.version)  # a test's fault: the engine keeps the adapter it had
            else:
                await self.engine.add_adapter(incoming.version, prepared)
                self.slots.set_version(incoming.version)
        end = time.perf_counter()
        return UpdateRecord(incoming.version, incoming.pull_s, prepared_at - start, 0.0, end - prepared_at, 0.0,
                            self.slots.in_flight, verified=bool(incoming.digests), checked=checked)

    async def _swap(self, version: int, apply: Callable[[], Awaitable[dict | None]], pull_s: float,
                    prepare_s: float) -> UpdateRecord:
        slots = self.slots
        async with self._swap_lock:
            if not self.partial_rollout and self.update_when == "idle":
                await slots.wait_empty()  # decode on with the old weights until nothing is in flight
            waited = time.perf_counter()
            if not self.partial_rollout:
                # every episode from one version: no new episode starts, those running end (all their
                # turns) with the old weights; in "idle" mode too, as an episode waiting for its tool holds
                # no engine slot
                await slots.drain_episodes()
            in_flight, start_wall, start = slots.in_flight, time.time(), time.perf_counter()
            await self.engine.pause("keep" if self.partial_rollout else "wait")
            if slots.in_flight:  # tests and chaos runs: die here, with requests frozen in the engine
                self.faults.reach("rollout_paused", version=version, in_flight=slots.in_flight)
            paused = time.perf_counter()
            # a test's fault: the engine keeps its weights while the loop records the version (the probe's case)
            ignored = self.faults.fires("engine_ignores_update", version=version)
            applied = None if ignored else await apply()
            loaded = time.perf_counter()
            if applied:  # the gloo plane: the version the engine confirmed (a newer one may have arrived)
                version = applied["version"]
            slots.set_version(version)
            await self.engine.resume()
            end = time.perf_counter()
            slots.record_pause(start_wall, end - start)
            return UpdateRecord(version, pull_s, prepare_s, paused - start, loaded - paused, end - start, in_flight,
                                episode_wait_s=start - waited, verified=bool(applied and applied["verified"]),
                                checked=int(applied["checked"]) if applied else 0)

    async def _watch(self) -> None:
        """Load every newer version the plane brings (skipping ones already replaced)."""
        try:
            while True:
                incoming = await self.receiver.next_async(self.version, WATCH_POLL_S)
                if incoming is None:  # short polls: no call stays pending when the actor is asked to exit
                    continue
                record = await self._load(incoming)
                record.probe_gap = await self._check_probe(record.version)
                self.store.record_load(self.name, dict(vars(record)))  # no reply awaited
        except asyncio.CancelledError:
            raise
        except BaseException as err:  # surfaced to every caller: a generator without weights must not go on
            self._failure = err
            self.slots.set_version(self.version)  # wake waiters so they see it
            logger.exception("rollout weight watcher failed")


    async def _check_probe(self, version: int) -> float | None:
        """The served-policy probe (operators/weights/probe.py) of the version just applied, when the trainer
        measured one: the engine scores it while decoding goes on (no other version loads meanwhile: this runs
        in the watcher); raises ServedPolicyMismatch beyond the tolerance. None: not due, or an engine that
        cannot score (no `score` method)."""
        score = getattr(self.engine, "score", None)
        if score is None:
            return None
        record = await self.store.probe_of_async(version)
        if record is None:
            return None
        return check_served(record, await score(list(record.token_ids), f"probe-{self.name}-v{version}"), self.name)


def wait_all(futures: list[concurrent.futures.Future]) -> list[GroupResult]:
    """Results in submission order (cancels the rest if one fails)."""
    try:
        return [future.result() for future in futures]
    except BaseException:
        for future in futures:
            future.cancel()
        raise
