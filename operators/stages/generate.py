"""Generate operator: samples `n` responses per prompt group with a rollout engine.

Use it in any Ray Data job (batch inference, evaluation) or in the RL pipeline, where it
also enforces admission control against the policy store:

    ds.map_batches(Generate, fn_constructor_kwargs={"model_path": path, "n": 4},
                   compute=ray.data.ActorPoolStrategy(size=2), batch_format="pandas")

Input rows need a `prompt` column: text, or chat messages (a list of `{role, content}`), rendered by
`operators.common.prompts.PromptRenderer` with `chat_template` ("auto": the tokenizer's chat template for
messages or with a `system_prompt`; "none"; or a Jinja file) and `system_prompt`. If a row has `train_step` and a policy store is given,
the group is generated only once the engine holds a version >= train_step - max_staleness (`_admit`,
the one staleness gate), with the newest weights the plane has brought (operators/weights/plane.py). Output adds `prompt_token_ids`, `prompt_text` (the prompt
as the model read it, template applied), `responses`,
`response_token_ids`, `behavior_logprobs`, `response_lengths`, `policy_version`,
`time_generate`, `time_weight_sync` and the call's busy interval: `generator_id`,
`generate_start`, `generate_end` (wall clock; weight pull included, admission wait
excluded). All other columns pass through.

`greedy=True` decodes one greedy response per prompt instead (evaluation); `sample(batch,
greedy=...)` generates with the weights loaded now, and `load_policy(version, weights)` loads
a given policy version: what an evaluator that is not gated on the store uses.

**In flight** (`in_flight=True`; engine 'vllm', or an engine class with `stream` such as the
benchmarks' simulator): the engine runs as an async engine in a
`RolloutLoop` (operators/engines/rollout.py) with up to `max_seqs_in_flight` sequences, fed by every call
the actor runs at once. Give the actor several calls (Ray Data's
`ActorPoolStrategy(max_tasks_in_flight_per_actor=k, max_concurrent_calls_per_actor=k,
enable_true_multi_threading=True)`): each call yields every group as its own one-row block the
moment its `n` samples are done, not when the call is. New policy versions are loaded by the loop
as soon as the store has them (pulled while decoding goes on); `partial_rollout=True` keeps the
requests in flight through the swap, so a response may span versions: `token_policy_versions`
records, per response token, the version that sampled it, `policy_version` is the oldest (what
staleness counts) and `policy_version_max` the newest. `time_weight_sync` is then the update
pauses the group sat through. The HF engine is call-synchronous: one call at a time per actor.

**Multi-turn** (`environment=...`, in flight only): each of a row's `n` responses is an episode
(operators/environments/environment.py; `RolloutLoop.submit_episodes`): the model's turns alternate with the
environment's observations, every turn a request of its own. The response tokens hold both;
`loss_masks` marks the model's (1) and the observations' (0), and the rows add `turns`,
`num_turns`, `episode_ends`, `env_rewards`, `tool_calls`, `tool_errors`, `env_errors`
(`add_episode_columns`). `responses` is the whole transcript after the prompt. Reusable as is in
a plain Ray Data job for agent evaluation: give the actor `environment` and `in_flight=True`.
"""

from __future__ import annotations

import concurrent.futures
import os
import time
import zlib
from typing import Iterator

import pandas as pd

from operators.engines.base import SamplingParams
from operators.engines.factory import make_engine, make_in_flight_engine
from operators.weights.probe import check_served
from operators.common.faults import FaultPoints
from operators.common.plain import plain
from operators.common.prompts import PromptFormat, PromptRenderer, is_messages


class Generate:
    def __init__(
        self,
        model_path: str,
        engine: str = "hf",
        n: int = 8,
        max_new_tokens: int = 16,
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int = 0,
        policy_store=None,
        max_staleness: int = 0,
        admission_timeout_s: float | None = None,
        engine_options: dict | None = None,
        greedy: bool = False,
        policy_version: int = 0,
        in_flight: bool = False,
        max_seqs_in_flight: int = 256,
        partial_rollout: bool = False,
        update_when: str = "drain",
        faults: FaultPoints = FaultPoints(),
        environment: str | None = None,
        environment_options: dict | None = None,
        max_turns: int = 4,
        max_episode_tokens: int = 256,
        episode_timeout_s: float = 300.0,
        chat_template: str = "auto",
        system_prompt: str | None = None,
    ):
        """`policy_version`: the version of the weights in `model_path` (0 for the base model; a
        checkpoint's step when evaluating it), recorded in every row and part of the sampling seed.
        `environment` (in flight only): run multi-turn episodes with it (operators/environments/environment.py;
        a builtin name such as "tools", or 'module:Class', built with `environment_options`), at most
        `max_turns` turns of at most `max_new_tokens` tokens each and `max_episode_tokens` tokens after
        the prompt per episode. An environment named 'agent:module:function' is an agent written against the
        openai client (operators/environments/agents.py), run per episode against this actor's rollout
        endpoint for at most `episode_timeout_s`, `max_turns` calls. `chat_template` and `system_prompt`: how
        prompts are rendered (operators/common/prompts.py)."""
        self.rollout = None
        self.model_path = model_path
        self.prompt_format = PromptFormat(chat_template, system_prompt)
        self._renderer: PromptRenderer | None = None
        self.environment = self.agent = self._agent_runner = None
        if environment is not None:
            if not in_flight:
                raise ValueError("an environment needs in_flight=True: every turn is a request to the in-flight "
                                 "engine (engine 'vllm', or an engine class with `stream`)")
            from operators.environments.agents import AgentRun, is_agent, resolve_agent
            from operators.environments.environment import EnvironmentFactory, resolve_environment

            if is_agent(environment):
                resolve_agent(environment)  # fail here, with the fix, not in the first episode
                self.agent = AgentRun(environment, environment_options, episode_timeout_s)
            else:
                resolve_environment(environment)
                self.environment = EnvironmentFactory(environment, environment_options)
        self.max_turns, self.max_episode_tokens = int(max_turns), int(max_episode_tokens)
        if in_flight:
            from operators.engines.rollout import RolloutLoop

            self.engine = make_in_flight_engine(engine, model_path, **(engine_options or {}))
        else:
            if partial_rollout:
                raise ValueError("partial_rollout needs in_flight=True (an engine that can pause requests in flight)")
            self.engine = make_engine(engine, model_path, **(engine_options or {}))
        self.params = SamplingParams(n=n, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed)
        self.greedy = greedy
        self.max_staleness = max_staleness
        self.admission_timeout_s = admission_timeout_s
        self.store = None
        self.policy_version = policy_version  # the weights loaded from model_path
        self.weight_sync_seconds = 0.0  # pulled and loaded since the last batch left
        self.busy_since: float | None = None  # wall clock when this call's work began
        self.generator_id = f"{os.uname().nodename}:{os.getpid()}"
        self.receiver = None  # call-synchronous engines: the object-store plane's receiver
        if policy_store is not None:  # the weight channel: a PolicyStoreClient, passed in by the job
            self.store = policy_store
            if not in_flight:
                from operators.weights.object_store import ObjectStoreReceiver

                self.receiver = ObjectStoreReceiver(policy_store)
        if in_flight:
            self.rollout = RolloutLoop(self.engine, max_seqs_in_flight=max_seqs_in_flight,
                                       partial_rollout=partial_rollout, store=self.store,
                                       initial_version=policy_version, name=self.generator_id,
                                       update_when=update_when, faults=faults)

    def __call__(self, batch: pd.DataFrame) -> Iterator[pd.DataFrame]:
        # A generator: each yielded part leaves as its own block, so rows of an earlier
        # step are never held back while this call waits for a later step's policy.
        if self.store is None or "train_step" not in batch.columns:
            self._admit(None)
            yield from self._generate(batch)
            return
        for step, part in batch.groupby("train_step", sort=True):
            self._admit(int(step) - self.max_staleness)
            yield from self._generate(part)

    def _generate(self, batch: pd.DataFrame) -> Iterator[pd.DataFrame]:
        if self.rollout is not None:
            yield from self._stream(batch, self.greedy)  # each group as it is done
        else:
            yield self.sample(batch, self.greedy)

    def _admit(self, min_version: int | None) -> None:
        """The staleness gate, the same for every engine: return once the engine holds a policy version
        >= `min_version` (None: no gate; a call-synchronous engine still loads a newer version if there is
        one). The in-flight loop's watcher loads versions as the plane brings them and this waits for it;
        a call-synchronous engine asks the object-store plane's receiver here and loads what it pulled."""
        if self.rollout is not None:
            if min_version is not None and self.store is not None:
                self.rollout.wait_version(min_version, self.admission_timeout_s)
            return
        if self.receiver is None:
            self.busy_since = time.time()
            return
        incoming = self.receiver.newest(self.policy_version, at_least=min_version, timeout_s=self.admission_timeout_s)
        self.busy_since = time.time() - (incoming.pull_s if incoming else 0.0)  # admitted: pulling weights is work
        if incoming is not None:
            self.weight_sync_seconds += incoming.pull_s
            self.load_policy(incoming.version, incoming.weights)

    def load_policy(self, version: int, state_dict) -> None:
        """Load the weights of policy `version` (the rows generated next record it)."""
        start = time.perf_counter()
        if self.rollout is not None:
            self.rollout.load_policy(version, state_dict)
        else:
            self.engine.load_weights(state_dict)
            self._check_probe(version)
        self.policy_version = version
        self.weight_sync_seconds += time.perf_counter() - start

    def _check_probe(self, version: int) -> None:
        """The served-policy probe of a version a call-synchronous engine loaded from the store (the in-flight
        loop checks its own: operators/engines/rollout.py); raises ServedPolicyMismatch beyond the tolerance."""
        score = getattr(self.engine, "score", None)
        record = self.store.probe_of(version) if self.store is not None and score is not None else None
        if record is not None:
            check_served(record, score(list(record.token_ids), f"probe-v{version}"), self.generator_id)

    # --- in flight ---------------------------------------------------------------------------------

    def _submit(self, batch: pd.DataFrame, greedy: bool):
        batch = batch.reset_index(drop=True)
        prompt_ids = self._encode(batch)
        params = SamplingParams(**{**self.params.__dict__, **({"n": 1, "temperature": 0.0} if greedy else {})})
        uids = [str(uid) for uid in batch.get("group_uid", batch["prompt"])]  # str(): messages too
        version = self.rollout.version
        seeds = [self._group_seed(uid, version, params.n) for uid in uids]
        if self.environment is None and self.agent is None:
            return batch, prompt_ids, self.rollout.submit(prompt_ids, params, seeds, uids)
        from operators.stages.reward import PIPELINE_COLUMNS

        columns = [c for c in batch.columns if c not in PIPELINE_COLUMNS]
        rows = [{c: plain(v) for c, v in row.items()} for row in batch[columns].to_dict("records")]
        if self.environment is not None:
            return batch, prompt_ids, self.rollout.submit_episodes(
                prompt_ids, params, seeds, uids, self.environment, rows, self.max_turns, self.max_episode_tokens)
        self.rollout.check_failure()
        runner = self._agents()
        return batch, prompt_ids, [self.rollout.run_on_loop(runner.group(
            list(ids), params.n, seed, self.agent, row, params.temperature, self.max_turns,
            self.max_episode_tokens)) for ids, seed, row in zip(prompt_ids, seeds, rows)]

    def _agents(self):
        """The agents' runner over this actor's rollout endpoint (started on first use)."""
        if self._agent_runner is None:
            from operators.engines.agent_episodes import AgentRunner
            from operators.engines.openai_endpoint import RolloutEndpoint

            endpoint = RolloutEndpoint(self.rollout, self.renderer(), temperature=self.params.temperature,
                                       top_p=self.params.top_p, max_new_tokens=self.params.max_new_tokens,
                                       seed=self.params.seed)
            endpoint.start()
            self._agent_runner = AgentRunner(endpoint, self.rollout.slots, self.engine.decode,
                                             self.rollout.check_failure)
        return self._agent_runner

    def _stream(self, batch: pd.DataFrame, greedy: bool) -> Iterator[pd.DataFrame]:
        """Each group as a one-row frame, in the order they finish."""
        batch, prompt_ids, futures = self._submit(batch, greedy)
        index = {future: i for i, future in enumerate(futures)}
        try:
            for future in concurrent.futures.as_completed(futures):
                i = index[future]
                yield self._rows(batch.iloc[[i]], [prompt_ids[i]], [future.result()])
        finally:
            for future in futures:  # a failed or abandoned call: stop its requests
                future.cancel()

    def _encode(self, batch: pd.DataFrame) -> list[list[int]]:
        """The prompts' token ids, rendered (operators/common/prompts.py); sets the batch's `prompt_text`. Text
        prompts with no template to apply are the engine's own `encode` (any engine class has one)."""
        prompts = list(batch["prompt"])
        default = self.prompt_format == PromptFormat()
        if default and not any(is_messages(p) for p in prompts):
            batch["prompt_text"] = [str(p) for p in prompts]
            return self.engine.encode([str(p) for p in prompts])
        renderer = self.renderer()
        batch["prompt_text"] = [renderer.render(p) for p in prompts]
        return renderer.encode(prompts)

    def renderer(self) -> PromptRenderer:
        """The prompt renderer, on the engine's tokenizer (or the model folder's)."""
        if self._renderer is None:
            tokenizer = getattr(self.engine, "tokenizer", None)
            if tokenizer is None:
                from transformers import AutoTokenizer

                tokenizer = AutoTokenizer.from_pretrained(self.model_path, local_files_only=True)
            self._renderer = PromptRenderer(tokenizer, self.prompt_format)
        return self._renderer

    def _group_seed(self, uid: str, version: int, n: int) -> int:
        """Stable per-group seed: same group and policy version -> same samples (vLLM gives the
        i-th sample seed + i, so leave room below 2**31)."""
        return (self.params.seed * 1_000_003 + zlib.crc32(f"{uid}@{version}".encode())) % (2**31 - max(n, 1))

    def _rows(self, batch: pd.DataFrame, prompt_ids: list[list[int]], results: list) -> pd.DataFrame:
        # agent episodes: the prompt the responses continue, when the agent wrote its own (operators/engines/
        # agent_episodes.py); the rendered text in prompt_text follows it
        prompt_ids = [ids if r.prompt_ids is None else r.prompt_ids for ids, r in zip(prompt_ids, results)]
        if any(r.prompt_ids is not None for r in results):
            tokenizer = self.renderer().tokenizer
            batch = batch.assign(prompt_text=[tokenizer.decode(ids) for ids in prompt_ids])
        columns = {
            "prompt_token_ids": prompt_ids,
            "responses": [r.sample.texts for r in results],
            "response_token_ids": [r.sample.token_ids for r in results],
            "behavior_logprobs": [r.sample.logprobs for r in results],
            "response_lengths": [[len(tokens) for tokens in r.sample.token_ids] for r in results],
            "token_policy_versions": [r.token_versions for r in results],
            "policy_version": [r.version_min for r in results],
            "policy_version_max": [r.version_max for r in results],
            "time_generate": [r.end - r.start for r in results],
            "time_weight_sync": [r.pause_s for r in results],
            "generator_id": [self.generator_id] * len(results),
            "generate_start": [r.start for r in results],
            "generate_end": [r.end for r in results],
        }
        # one concat, not a column insert each (pandas copies its blocks on every insert: 13% of a tiny
        # generate actor's time, measured with py-spy)
        batch = batch.reset_index(drop=True).drop(columns=[c for c in columns if c in batch.columns])
        batch = pd.concat([batch, pd.DataFrame(columns, index=batch.index)], axis=1)
        if results and results[0].episodes is not None:
            add_episode_columns(batch, [r.episodes for r in results])
        return batch

    def close(self) -> None:
        """Stop the engine's processes now (vLLM's engine core and workers), not at the interpreter's exit: a
        process that builds one Generate after another (the race's evaluators) would keep each old engine."""
        if self._agent_runner is not None:  # before the loop it serves on: no agent calls in after it
            self._agent_runner.close()
            self._agent_runner.endpoint.close()
            self._agent_runner = None
        if self.rollout is not None:
            self.rollout.close()
            self.rollout = None
        elif hasattr(self.engine, "close"):  # a call-synchronous engine (VLLMEngine; HF's holds no process)
            self.engine.close()
        if self.environment is not None:  # after the rollout: no episode calls a tool any more
            self.environment.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def _call_seed(self, batch: pd.DataFrame) -> int:
        """Stable per-call seed: same rows and policy version -> same samples."""
        key = "|".join(map(str, batch.get("group_uid", batch["prompt"]))) + f"@{self.policy_version}"
        return (self.params.seed * 1_000_003 + zlib.crc32(key.encode())) % (2**31)

    def sample(self, batch: pd.DataFrame, greedy: bool = False) -> pd.DataFrame:
        """The batch with its responses, from the weights loaded now (no admission gate)."""
        if self.rollout is not None:
            from operators.engines.rollout import wait_all

            batch, prompt_ids, futures = self._submit(batch, greedy)
            return self._rows(batch, prompt_ids, wait_all(futures)) if len(batch) else batch
        if self.store is None:  # nothing to wait for: the work starts now
            self.busy_since = time.time()
        start = time.perf_counter()
        batch = batch.reset_index(drop=True).copy()
        prompt_ids = self._encode(batch)
        greedy_params = {"n": 1, "temperature": 0.0} if greedy else {}
        params = SamplingParams(**{**self.params.__dict__, "seed": self._call_seed(batch), **greedy_params})
        groups = self.engine.generate(prompt_ids, params) if len(batch) else []
        batch["prompt_token_ids"] = prompt_ids
        batch["responses"] = [group.texts for group in groups]
        batch["response_token_ids"] = [group.token_ids for group in groups]
        batch["behavior_logprobs"] = [group.logprobs for group in groups]
        batch["response_lengths"] = [[len(tokens) for tokens in group.token_ids] for group in groups]
        batch["policy_version"] = self.policy_version
        batch["time_generate"] = (time.perf_counter() - start) / max(len(batch), 1)
        batch["time_weight_sync"] = self.weight_sync_seconds / max(len(batch), 1)
        batch["generator_id"] = self.generator_id
        batch["generate_start"] = self.busy_since
        batch["generate_end"] = time.time()
        self.weight_sync_seconds = 0.0
        return batch


def add_episode_columns(batch: pd.DataFrame, groups: list[list]) -> None:
    """The columns of multi-turn episodes (one list entry per response of a row): `loss_masks` (1 per
    policy token, 0 per observation token), `turns` (each episode's turns as JSON: text, tool_call,
    observation, reward, error, ended_by, tokens, version), `num_turns`, `episode_ends` (what ended
    each: done, eos, max_turns, token_budget, env_error), `env_rewards` (the environment's rewards,
    summed per episode), and per row `tool_calls`, `tool_errors`, `env_errors`."""
    import json

    batch["loss_masks"] = [[list(e.loss_mask) for e in episodes] for episodes in groups]
    batch["turns"] = [[json.dumps(e.turns) for e in episodes] for episodes in groups]
    batch["num_turns"] = [[len(e.turns) for e in episodes] for episodes in groups]
    batch["episode_ends"] = [[e.end for e in episodes] for episodes in groups]
    batch["env_rewards"] = [[float(e.reward) for e in episodes] for episodes in groups]
    batch["tool_calls"] = [sum(e.tool_calls for e in episodes) for episodes in groups]
    batch["tool_errors"] = [sum(e.tool_errors for e in episodes) for episodes in groups]
    batch["env_errors"] = [sum(e.env_errors for e in episodes) for episodes in groups]
