"""The served-policy probe (operators/weights/probe.py): when it is due, what it measures on the trainer's side,
that an engine scores it the same way, and that a gap beyond the tolerance names the version and the engine."""

from __future__ import annotations

import pytest

from operators.weights.probe import (FP32_TOLERANCE, LOW_PRECISION_TOLERANCE, ProbeRecord, ServedPolicyMismatch,
                                     ServedProbe, check_served, probe_gap, probe_tolerance, served_probe)
from operators.workers.settings import TrainerSettings


def test_due_on_every_nth_published_version_never_on_the_model_folders_own():
    calls = []
    probe = ServedProbe([1, 5, 6], every=2, tolerance=1e-3, logprobs=lambda ids: calls.append(ids) or [-1.0, -2.0])
    assert [v for v in range(7) if probe.due(v)] == [2, 4, 6]
    assert probe.measure(3) is None and not calls  # no forward when not due
    assert probe.measure(4) == ProbeRecord(4, (1, 5, 6), (-1.0, -2.0), 1e-3) and calls == [[1, 5, 6]]
    assert not ServedProbe([1, 2], every=0, tolerance=1e-3, logprobs=lambda ids: [0.0]).due(1)


def test_the_gap_is_the_mean_absolute_difference_and_beyond_the_tolerance_names_version_and_engine():
    record = ProbeRecord(7, (1, 2, 3), (-1.0, -2.0), tolerance=0.1)
    assert probe_gap([-1.1, -1.9], record.logprobs) == pytest.approx(0.1)
    assert probe_gap([-1.0], record.logprobs) == float("inf")  # another sequence was scored
    assert check_served(record, [-1.05, -2.05], "gen-a") == pytest.approx(0.05)
    with pytest.raises(ServedPolicyMismatch, match=r"engine gen-b does not serve the trained policy version 7: .*"
                                                   r"by 0\.5 per token .*rollout\.probe_tolerance"):
        check_served(record, [-1.5, -2.5], "gen-b")


def test_default_tolerance_by_dtype():
    assert probe_tolerance(None, "fp32", "float32") == FP32_TOLERANCE
    assert probe_tolerance(None, "bf16", "float32") == LOW_PRECISION_TOLERANCE
    assert probe_tolerance(None, "fp32", "bfloat16") == LOW_PRECISION_TOLERANCE
    assert probe_tolerance(None, "fp32", "auto") == LOW_PRECISION_TOLERANCE  # the model's dtype, often bf16
    assert probe_tolerance(0.2, "fp32", "float32") == 0.2


def test_the_trainer_and_the_hf_engine_score_the_probe_alike_and_a_changed_weight_shows(tiny_model_path):
    """The trainer's side (the module in eval mode, whatever mode it was in) and the HF engine's `score` give the
    same log-probs for the same weights; one changed weight moves them far beyond the fp32 tolerance."""
    import torch
    from transformers import AutoModelForCausalLM

    from operators.engines.hf import HFEngine

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, local_files_only=True, dtype=torch.float32)
    model.train()
    probe = served_probe(torch, model, torch.device("cpu"), TrainerSettings(model_path=tiny_model_path))
    assert model.training  # its mode is restored
    record = probe.measure(1)
    assert 8 <= len(record.token_ids) <= 32 and len(record.logprobs) == len(record.token_ids) - 1
    engine = HFEngine(tiny_model_path)
    assert check_served(record, engine.score(list(record.token_ids)), "hf") < 1e-6
    with torch.no_grad():
        engine.model.model.layers[0].mlp.down_proj.weight.mul_(1.5)
    with pytest.raises(ServedPolicyMismatch, match="version 1"):
        check_served(record, engine.score(list(record.token_ids)), "hf")
