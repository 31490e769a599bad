"""What every config section shares: the section base (unknown keys and NaN refused), the error types that
carry each problem's field path, the types of resource fields, and `WorldChecks`, the checks of what a config
names (models, reward functions, environments, engines, algorithm names) that the sections call while they
validate but do not hold: pipelines/config/world.py gives them through pydantic's validation context.

This module and the section modules (pipelines/config/model.py ... pipelines/config/job.py) import no
operators and nothing outside pipelines/config beyond pydantic: what needs the operators is world.py's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Callable, Optional, Union

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationInfo


class CrossFieldProblems(ValueError):
    """Problems a model validator found, each naming its own full field path ('full.field.path: message'),
    where pydantic would put them at the path of the section whose validator raised them. pydantic keeps the
    exception (its error's ctx['error']), and pipelines/config/load.py lists each problem at its own path."""

    def __init__(self, lines: list[str]):
        self.problems = [(path, text) for path, _, text in (line.partition(": ") for line in lines)]
        super().__init__("\n".join(lines))


def raise_at(problems: list[str]) -> None:
    """Raise cross-field problems, each 'full.field.path: message', from a model validator."""
    if problems:
        raise CrossFieldProblems(problems)


class ConfigError(Exception):
    """A config failed validation. `problems` holds (field path, message) pairs."""

    def __init__(self, problems: list[tuple[str, str]], source: str = "config"):
        self.problems = problems
        lines = [f"{source}: {len(problems)} problem(s) found:"]
        lines += [f"  - {path}: {message}" for path, message in problems]
        super().__init__("\n".join(lines))


class Section(BaseModel):
    # allow_inf_nan=False: YAML's .nan and .inf are refused for every number (a NaN weight or threshold
    # would silently poison every reward or success count).
    model_config = ConfigDict(extra="forbid", validate_default=True, allow_inf_nan=False)


def _schedulable_gpus(value: float) -> float:
    if value > 1 and value != int(value):
        raise ValueError(f"{value} GPUs cannot be scheduled; use a fraction below 1 or a whole number")
    return value


def _positive_resources(resources: dict[str, float]) -> dict[str, float]:
    bad = {name: amount for name, amount in resources.items() if amount <= 0 or name in ("CPU", "GPU")}
    if bad:
        raise ValueError(f"{bad}: custom resources need an amount > 0, and CPU/GPU go in num_cpus/num_gpus")
    return resources


def _actor_count(value):
    """A count (4) or a range min-max ('1-4', [1, 4]) of actors; a range whose ends agree is a count."""
    bounds = value
    if isinstance(value, str):
        text = value.strip()
        bounds = text.split("-", 1) if "-" in text else text
    if isinstance(bounds, (list, tuple)):
        try:
            low, high = (int(str(bound).strip()) for bound in bounds)
        except ValueError:
            raise ValueError(f"{value!r}: give a count (4) or a range min-max ('1-4' or [1, 4])") from None
        if not 1 <= low <= high:
            raise ValueError(f"{value!r}: a range min-max needs 1 <= min <= max, e.g. '1-4'")
        return low if low == high else (low, high)
    try:
        count = int(bounds)
    except (TypeError, ValueError):
        raise ValueError(f"{value!r}: give a count (4) or a range min-max ('1-4' or [1, 4])") from None
    if count < 1 or count != bounds and not isinstance(bounds, str):
        raise ValueError(f"{value!r}: a count of actors is a whole number >= 1 (or a range min-max, '1-4')")
    return count


GpuCount = Annotated[float, Field(ge=0), AfterValidator(_schedulable_gpus)]
# A fixed pool (an int) or Ray Data's autoscaling actor pool between two sizes (a (min, max) tuple).
ActorCount = Annotated[Union[int, tuple[int, int]], BeforeValidator(_actor_count)]
CustomResources = Annotated[dict[str, float], AfterValidator(_positive_resources)]


@dataclass(frozen=True)
class WorldChecks:
    """The checks of what a config names, each given by pipelines/config/world.py (WORLD_CHECKS) through
    pydantic's validation context (`WORLD`): load.py validates with it, so each problem is found in the same
    pass, in the same order, as every other field's. A section built in code without that context (from a
    config already validated, or its defaults) skips them: each default below checks nothing, and a question
    answered None is "not known here", for which the cross-field rule that asks it says nothing.

    A check returns the value (a model folder resolved) or raises ValueError with the message and the fix."""

    model_path: Callable[[str, str], str] = lambda path, field_name: path  # (path, field name) -> path
    engine: Callable[[str], str] = lambda engine: engine  # installed?
    reward_function: Callable[[str], str] = lambda name: name  # importable?
    environment: Callable[[str], str] = lambda name: name  # importable?
    environment_options: Callable[[str, dict], None] = lambda name, options: None  # does the class take them?
    algorithm_name: Callable[[str, str], str] = lambda field_name, name: name  # registered? (AlgorithmConfig field)
    # questions of the cross-field rules (None: not known without the world)
    token_estimator: Callable[[str], Optional[bool]] = lambda name: None  # advantages from a critic's values?
    # a built-in estimator that compares the responses to one prompt (with one response each gives 0)?
    group_estimator: Callable[[str], Optional[bool]] = lambda name: None
    # the policy's tokens per response: (max_new_tokens[, max_turns, max_episode_tokens]) -> budget
    policy_budget: Callable[..., Optional[int]] = lambda max_new_tokens, *episode: None


# The key of pydantic's validation context under which the WorldChecks are given.
WORLD = "world"
NO_WORLD = WorldChecks()


def world_checks(info: ValidationInfo | None) -> WorldChecks:
    """The checks given with this validation (pipelines/config/world.py's), or none."""
    return ((info.context if info is not None else None) or {}).get(WORLD, NO_WORLD)
