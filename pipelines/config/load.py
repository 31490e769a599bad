"""A config from where it is written: a YAML file (`load_config`), a parsed tree (`config_from_tree`: a
saved run's config), `--set KEY=VALUE` overrides (`parse_overrides`), and back to dotted keys (`flatten`: MLflow
params and a run's saved config).

Loading runs the schema (pipelines/config/job.py and its sections: every field and how they fit together, with
world.py's checks of what the fields name) and then the checks against the world (pipelines/config/world.py:
dataset files, models, the declared cluster), and raises one `ConfigError` listing every problem with its
field path and the fix.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from pipelines.config.base import ConfigError, CrossFieldProblems
from pipelines.config.job import JobConfig
from pipelines.config.world import SCHEMA_CONTEXT, world_problems

_FIX_BY_TYPE = {
    "extra_forbidden": "unknown key; remove it or check its spelling",
    "missing": "required; add it",
}


def _format_pydantic(err: ValidationError) -> list[tuple[str, str]]:
    problems = []
    for item in err.errors(include_url=False):
        loc = [str(part) for part in item["loc"]]
        cross_field = item.get("ctx", {}).get("error")
        if isinstance(cross_field, CrossFieldProblems):  # cross-field problems name their own full paths
            problems += cross_field.problems
            continue
        message = item["msg"].removeprefix("Value error, ")
        path = ".".join(loc) or "(top level)"
        hint = _FIX_BY_TYPE.get(item["type"])
        if item["type"] == "finite_number":
            message = f"{item.get('input')!r} is not a finite number; give a finite value"
        elif hint:
            message = hint
        elif item["type"] != "value_error":
            message = f"{message} (got {item.get('input')!r})"
        problems.append((path, message))
    return problems


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for depth, part in enumerate(parts[:-1]):
        child = node.get(part, {})
        if isinstance(child, list) or parts[depth + 1].isdigit() and not child:  # a list: given whole, not by index
            raise ConfigError([(dotted, _list_fix(".".join(parts[:depth + 1]), child, parts[depth + 1:], value))],
                              "--set")
        if not isinstance(child, dict):
            raise ConfigError([(dotted, f"{part!r} is not a section; cannot set a key under it")], "--set")
        node = node.setdefault(part, child)
    node[parts[-1]] = value


def _list_fix(field: str, current: Any, rest: list[str], value: Any) -> str:
    """What `--set` into a list by index says: the list is given whole, here with the change made."""
    example = [dict(item) if isinstance(item, dict) else item for item in current] if isinstance(current, list) else []
    index = int(rest[0]) if rest[0].isdigit() else -1
    if 0 <= index < len(example) and isinstance(example[index], dict) and len(rest) == 2:
        example[index][rest[1]] = value
    elif len(rest) == 2 and rest[0].isdigit():
        example = [{rest[1]: value}]
    else:
        example = [{"name": "...", "weight": 1.0}] if field == "reward.functions" else example or ["..."]
    shown = yaml.safe_dump(example, default_flow_style=True, width=10**6).strip()
    return (f"{field} is a list, which --set cannot reach into by index; give the whole list, e.g. "
            f"--set '{field}={shown}'")


def duplicate_keys(text: str) -> list[tuple[str, str]]:
    """(field, message) for each key given twice in one mapping, with both line numbers (YAML's loader keeps
    the last and drops the first without a word)."""
    problems = []

    def walk(node, path: str) -> None:
        if isinstance(node, yaml.MappingNode):
            first: dict[str, int] = {}
            for key, child in node.value:
                name = key.value if isinstance(key, yaml.ScalarNode) else str(key.value)
                field = f"{path}.{name}" if path else name
                line = key.start_mark.line + 1
                if name in first and name != "<<":
                    problems.append((field, f"given twice, at lines {first[name]} and {line}; YAML would keep "
                                     f"only the second and drop the first without a word: keep one (merge them)"))
                first.setdefault(name, line)
                walk(child, field)
        elif isinstance(node, yaml.SequenceNode):
            for index, child in enumerate(node.value):
                walk(child, f"{path}.{index}")

    walk(yaml.compose(text, Loader=yaml.SafeLoader), "")
    return problems


def parse_overrides(overrides: list[str]) -> list[tuple[str, Any]]:
    """Parse `a.b=value` strings; values are YAML scalars or lists (`--set train.lr=1e-3`)."""
    parsed, problems = [], []
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            problems.append((item, "expected KEY=VALUE, e.g. --set train.lr=0.001"))
            continue
        try:
            parsed.append((key.strip(), yaml.safe_load(raw) if raw.strip() else None))
        except yaml.YAMLError as err:  # safe_load refuses python tags too: nothing is constructed
            problems.append((key.strip(), f"value is not valid YAML ({str(err).splitlines()[0]}); quote it or fix it"))
    if problems:
        raise ConfigError(problems, "--set")
    return parsed


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> JobConfig:
    """Read YAML (safe loader), apply `--set` overrides, validate. Raises ConfigError."""
    tree: dict = {}
    source = str(path) if path else "config"
    if path is not None:
        file = Path(path)
        if file.is_dir():
            found = sorted(str(f) for f in file.glob("*.yaml"))[:5]
            raise ConfigError([("(file)", f"{path} is a folder, not a YAML file; pass a config file"
                                + (f", e.g. one of {found}" if found else " such as configs/tiny_grpo.yaml"))])
        if not file.is_file():
            raise ConfigError([("(file)", f"{path} does not exist; pass a YAML file such as configs/tiny_grpo.yaml")])
        try:
            text = file.read_text(encoding="utf-8")
            repeated = duplicate_keys(text)
            tree = yaml.safe_load(text)
        except UnicodeDecodeError as err:
            raise ConfigError([("(file)", f"not UTF-8 text ({err.reason} at byte {err.start}); save it as UTF-8")],
                              source) from None
        except yaml.YAMLError as err:
            raise ConfigError([("(file)", f"not valid YAML: {err}")], source) from None
        if repeated:
            raise ConfigError(repeated, source)
        if tree is None:
            raise ConfigError([("(file)", "the file is empty (no sections); write the sections you change (every "
                                "field has a default: see configs/tiny_grpo.yaml), or run the default tiny job "
                                "with `streamrl run configs/tiny_grpo.yaml`")], source)
        if not isinstance(tree, dict):
            raise ConfigError([("(top level)", "expected a mapping of sections (model:, data:, ...)")], source)
    return config_from_tree(tree, overrides, source)


def config_from_tree(tree: dict, overrides: list[str] | None = None, source: str = "config") -> JobConfig:
    """Apply `--set` overrides to a config tree (a parsed YAML mapping) and validate it. Raises ConfigError."""
    for key, value in parse_overrides(overrides or []):
        _set_dotted(tree, key, value)
    try:
        cfg = JobConfig.model_validate(tree, context=SCHEMA_CONTEXT)  # with the checks of what it names: see world.py
    except ValidationError as err:
        raise ConfigError(_format_pydantic(err), source) from None
    # The schema holds: now what it names, in one pass (dataset files, the declared cluster, the memory).
    problems = world_problems(cfg)
    if problems:
        raise ConfigError(problems, source)
    return cfg


def flatten(config: BaseModel) -> dict[str, Any]:
    """Dotted-key view of a config, e.g. {'train.lr': 0.002}, for MLflow params."""
    out: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for key, child in value.items():
                walk(f"{prefix}.{key}" if prefix else key, child)
        elif isinstance(value, list) and value and isinstance(value[0], dict):
            for index, child in enumerate(value):
                walk(f"{prefix}.{index}", child)
        else:
            out[prefix] = value

    walk("", config.model_dump(mode="json"))
    return out
