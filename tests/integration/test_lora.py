"""LoRA on a policy rank (train.lora: operators/workers/lora.py, operators/weights/lora_merge.py): a step trains
the adapters alone and equals the same step in plain torch with peft; what the rank publishes and exports is the
base model's weights with the adapters merged, as peft merges them, and moves the policy; a checkpoint holds the
adapters and their optimizer state, not the frozen weights, and resumes to the same next step. The ZeRO-3
variant (two ranks, the merged walk gathering each adapted layer) is in test_trainer.py. In process, no Ray."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from operators.algorithms.step_batch import explode, step_normalisers
from pipelines.config.load import load_config
from reference_step import reference_updates
from samples import step_samples

LORA = ["rollout.n=4", "train.groups_per_step=2", "rollout.groups_per_call=1", "train.lora={r: 4, alpha: 8}",
        "train.lr=0.02"]


def worker_for(cfg, model_path: str):
    from operators.workers.deepspeed_setup import free_port
    from operators.workers.train_worker import TrainWorker
    from pipelines.runtime.trainer_settings import trainer_settings

    return TrainWorker(0, 1, free_port(), trainer_settings(cfg, model_path), None)


def peft_merged(module) -> dict[str, np.ndarray]:
    """peft's own merge (LoraLayer.merge) on a copy: the base model's names, the adapters folded in."""
    from peft.tuners.lora import LoraLayer

    merged = copy.deepcopy(module)
    for sub in merged.modules():
        if isinstance(sub, LoraLayer):
            sub.merge()
    return {name.replace(".base_layer.", "."): tensor.detach().numpy().copy()
            for name, tensor in merged.state_dict().items() if ".lora_" not in name}


class StartFrom:
    """The reference's model (tests/reference_step.py): the pretrained one with the worker's adapters as they
    were before its step; its weights, merged by peft."""

    def __init__(self, adapters: dict, cfg):
        self.adapters, self.lora = adapters, cfg.train.lora

    def __call__(self, model):
        from peft import LoraConfig, inject_adapter_in_model

        config = LoraConfig(r=self.lora.r, lora_alpha=self.lora.alpha, lora_dropout=self.lora.dropout,
                            target_modules=self.lora.target_modules)
        model = inject_adapter_in_model(config, model)
        missing = set(self.adapters) - set(model.state_dict())
        assert not missing, missing
        model.load_state_dict(self.adapters, strict=False)
        return model

    def weights(self, model) -> dict[str, np.ndarray]:
        return peft_merged(model)


def log_probs(model_path: str, weights: dict, samples: dict) -> np.ndarray:
    """Each response token's log-prob under `weights` loaded into a plain HF model (what an engine serves)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, local_files_only=True, dtype=torch.float32)
    model.load_state_dict({name: torch.from_numpy(value) for name, value in weights.items()})
    found = []
    with torch.no_grad():
        for prompt, response in zip(samples["prompt_token_ids"], samples["response_token_ids"]):
            ids = torch.tensor([[*prompt, *response]])
            logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1]
            found += torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None])[:, 0].tolist()
    return np.array(found)


def test_a_lora_step_trains_the_adapters_alone_and_publishes_them_merged(tiny_model_path):
    pytest.importorskip("peft", reason="peft is not installed (pip install 'streamrl[lora]')")
    samples = explode(step_samples(tiny_model_path))
    samples["ref_logprobs"] = samples["behavior_logprobs"]  # the reference step reads them (kl_coef 0 here)
    tokens, sequences = step_normalisers(samples)
    cfg = load_config(None, LORA)
    worker = worker_for(cfg, tiny_model_path)
    module = worker.engine.module
    before = {name: tensor.detach().clone() for name, tensor in module.state_dict().items()}
    adapters = {name: tensor for name, tensor in before.items() if ".lora_" in name}
    trainable = {name for name, param in module.named_parameters() if param.requires_grad}
    assert trainable == set(adapters) and len(adapters) == 28  # A and B on each of 7 linear layers x 2 layers
    base = worker.state_dict()  # B starts at zero: version 0 is the pretrained model, in its own names
    pretrained = log_probs(tiny_model_path, base, samples)

    result = worker.train_step(samples, tokens, sequences)
    partitions = [worker.mini_batches(len(samples["advantages"]), 0)]
    losses, norms, reference = reference_updates(tiny_model_path, samples, cfg, partitions,
                                                 adapt=StartFrom(adapters, cfg))

    np.testing.assert_allclose(result["policy_loss"], losses[0], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(result["grad_norm"], norms[0], rtol=1e-5)
    after = module.state_dict()
    for name, tensor in before.items():
        moved = not np.array_equal(after[name].numpy(), tensor.numpy())
        # the frozen weights stay; B starts at 0, so the first step moves B only (A's gradient is B^T x ...)
        assert moved == (".lora_B." in name), name
    optimizer_state = sum(state["exp_avg"].numel() for state in worker.engine.optimizer.state.values())
    assert optimizer_state == sum(tensor.numel() for tensor in adapters.values())  # no state for frozen weights

    published = worker.state_dict()  # what the publisher and the HF export walk: merged, the base model's names
    assert published.keys() == base.keys() and not any("lora" in name for name in published)
    merged = peft_merged(module)
    for name, value in published.items():
        np.testing.assert_array_equal(value, merged[name], err_msg=name)
        # Adam's first step is ~lr*sign(g) on B: an entry whose gradient is ~0 may flip sign under float
        # reassociation (as in test_trainer.py), so the difference from the reference is bounded on average
        assert np.abs(value - reference[name]).mean() < 1e-6, name
    # the policy moved more than the on-policy bound of tests/e2e/test_off_policy.py (1e-3 on each ratio): an
    # engine served the pretrained weights instead of the merged ones would fail that test
    served = log_probs(tiny_model_path, published, samples)
    assert np.abs(served - pretrained).max() > 1e-2


def test_a_lora_checkpoint_holds_the_adapters_and_resumes_to_the_same_step(tiny_model_path, tmp_path):
    pytest.importorskip("peft", reason="peft is not installed (pip install 'streamrl[lora]')")
    import torch

    samples = explode(step_samples(tiny_model_path))
    tokens, sequences = step_normalisers(samples)
    cfg = load_config(None, LORA)
    first = worker_for(cfg, tiny_model_path)
    first.train_step(samples, tokens, sequences)
    first.save_checkpoint(str(tmp_path / "step_1"))
    saved = torch.load(tmp_path / "step_1" / "engine" / "mp_rank_00_model_states.pt", weights_only=False)
    assert saved["module"] and all(".lora_" in name for name in saved["module"])  # no frozen weight in it
    first.train_step(samples, tokens, sequences)
    uninterrupted = first.state_dict()

    resumed = worker_for(cfg, tiny_model_path)
    assert resumed.load_checkpoint(str(tmp_path / "step_1"), 1) == 1
    resumed.train_step(samples, tokens, sequences)
    for name, value in resumed.state_dict().items():
        np.testing.assert_array_equal(value, uninterrupted[name], err_msg=name)

    exported = resumed.save_pretrained(str(tmp_path / "export"))
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(exported, local_files_only=True, dtype=torch.float32)
    for name, tensor in loaded.state_dict().items():
        np.testing.assert_array_equal(tensor.numpy(), uninterrupted[name], err_msg=name)


def test_the_reference_on_the_trainer_is_the_base_model_and_its_kl_enters_the_loss(tiny_model_path):
    """reference.on_trainer (the default with train.lora): the rank computes pi_ref itself, its adapters off, and
    it equals the pretrained model's log-probs (what the RefLogprob stage would give) with no second model. At
    the first step the adapters are at peft's start (B = 0) and the KL is 0; after it they moved and it is not.
    The adapters still train afterwards (switching them off and on again keeps their requires_grad)."""
    pytest.importorskip("peft", reason="peft is not installed (pip install 'streamrl[lora]')")
    from safetensors.numpy import load_file

    samples = explode(step_samples(tiny_model_path))
    samples.pop("ref_logprobs", None)  # the stage is not in the DAG: the rank must make them
    tokens, sequences = step_normalisers(samples)
    cfg = load_config(None, LORA + ["reference={}", "algorithm.kl_coef=0.5"])
    worker = worker_for(cfg, tiny_model_path)
    first = worker.train_step(samples, tokens, sequences)
    assert abs(first["kl_ref"]) < 1e-7, first["kl_ref"]
    second = worker.train_step(samples, tokens, sequences)
    assert second["kl_ref"] > 1e-6, second["kl_ref"]

    base = log_probs(tiny_model_path, load_file(f"{tiny_model_path}/model.safetensors"), samples)
    reference = worker._frozen_logprobs(samples, reference=True).values
    np.testing.assert_allclose(reference, base, atol=1e-5)
    policy = worker._frozen_logprobs(samples).values
    assert np.abs(policy - base).max() > 1e-3  # the policy is not the reference
    adapters = [param for name, param in worker.engine.module.named_parameters() if ".lora_" in name]
    assert adapters and all(param.requires_grad for param in adapters)
    before = [param.detach().clone() for param in adapters]
    worker.train_step(samples, tokens, sequences)
    assert any(not (param.detach() == old).all() for param, old in zip(adapters, before))
