"""Rollout engines behind one small interface (see `base.RolloutEngine`)."""

from operators.engines.base import GroupSample, RolloutEngine, SamplingParams, make_engine

__all__ = ["GroupSample", "RolloutEngine", "SamplingParams", "make_engine"]
