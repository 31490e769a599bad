"""Accuracy among the answers given (operators/algorithms/eval_metrics.py answered_metrics): with the
answer_format reward, a rise that is only the format shows as such, in training and in evaluation."""

from __future__ import annotations

import math

import pandas as pd

from operators.algorithms.eval_metrics import answered_metrics, summarize
from operators.stages.train_metrics import reward_metrics


def groups(rewards, formats):
    return pd.DataFrame({"rewards": rewards, "reward_answer_format": formats,
                         "response_lengths": [[5] * len(r) for r in rewards]})


def test_success_among_answered_counts_only_the_samples_that_stated_an_answer():
    # right answers score 1 + 0.2 format; a stated wrong answer 0.2; no stated answer 0
    table = groups([[1.2, 0.2, 0.0, 0.0], [0.2, 0.2, 1.2, 0.0]], [[1, 1, 0, 0], [1, 1, 1, 0]])
    assert answered_metrics(table, success_threshold=1.0) == {"answered_rate": 5 / 8, "success_among_answered": 2 / 5}


def test_no_answer_stated_is_nan_and_no_format_reward_is_no_metric():
    figures = answered_metrics(groups([[0.0, 0.0]], [[0, 0]]))
    assert figures["answered_rate"] == 0.0 and math.isnan(figures["success_among_answered"])
    assert answered_metrics(pd.DataFrame({"rewards": [[1.0]], "response_lengths": [[3]]})) == {}


def test_training_and_evaluation_report_it():
    table = groups([[1.2, 0.2]], [[1, 1]]).assign(reward_errors=0, reward_timeouts=0, staleness=0)
    metrics = reward_metrics(table, success_threshold=1.0)
    assert metrics["answered_rate"] == 1.0 and metrics["success_among_answered"] == 0.5
    scored = pd.concat([groups([[1.2, 0.0]], [[1, 0]]).assign(mode="sampled"),
                        groups([[0.2]], [[1]]).assign(mode="greedy")]).assign(prompt_id="p", policy_version=3)
    figures = summarize(scored, success_threshold=1.0)
    assert figures["eval/answered_rate"] == 0.5 and figures["eval/success_among_answered"] == 1.0
    assert figures["eval/greedy_answered_rate"] == 1.0 and figures["eval/greedy_success_among_answered"] == 0.0
