"""Models from the Hugging Face Hub: a Hub id (`org/name`) at a revision, resolved once into the user's
Hugging Face cache (HF_HUB_CACHE / HF_HOME) with `huggingface_hub.snapshot_download`, downloading only
what a causal LM needs (`HUB_FILES`); with HF_HUB_OFFLINE=1 only the cache is read. pipelines/data/models.py
decides when a name is a Hub id and calls `hub_snapshot`.

Config checks call this module, so it imports only the standard library at the top.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable


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

    from pipelines.config.base import ConfigError

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
            if hub_offline():
                why, fixes = "HF_HUB_OFFLINE is set, which forbids downloading it", _hub_fixes(repo, revision)
            else:  # `streamrl validate`: nothing is downloaded to check a config
                why = "`streamrl validate` downloads nothing"
                fixes = (f"download it first (`hf download {repo}{f' --revision {revision}' if revision else ''}`; "
                         "`streamrl run` downloads it where the Hub is reachable), or give a local folder made by "
                         "save_pretrained")
            message = (f"Hub model {repo!r}{at} is not in the Hugging Face cache (looked in {looked}){local} and "
                       f"{why}; {fixes}")
        else:
            detail = " ".join(str(err).split())[:400]
            message = (f"cannot download Hub model {repo!r}{at} into {cache}{local}: "
                       f"{type(err).__name__}: {detail}; check the id and model.revision, the network (or "
                       f"HF_ENDPOINT) and, for a gated or private model, your token (`hf auth login`); or "
                       f"{_hub_fixes(repo, revision, offline=False)}")
        raise ConfigError([(field, message)]) from None
    problem = snapshot_problem(Path(folder))
    if problem:
        raise ConfigError([(field, f"Hub model {repo!r}{at} in {folder} {problem}; "
                                   f"{_hub_fixes(repo, revision, offline)}")])
    return folder


def snapshot_problem(folder: Path) -> str | None:
    """What a downloaded snapshot lacks to be loaded as a causal LM (None: nothing)."""
    if not (folder / "config.json").is_file():
        return "has no config.json (is it a model repository?)"
    weights = weights_problem(folder)
    if weights:
        return weights + "; pick a revision or a repository that has them"
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        return f"has no tokenizer (none of {list(TOKENIZER_FILES)})"
    return None


def weights_problem(folder: Path, pickled: bool = False) -> str | None:
    """What a model folder lacks of its weights (None: nothing): a weights file, or shards its index names.
    `pickled`: PyTorch's pytorch_model.bin counts too (a local folder; a Hub snapshot is never given one)."""
    for index_name in ("model.safetensors.index.json",) + (("pytorch_model.bin.index.json",) if pickled else ()):
        index = folder / index_name
        if index.is_file():
            shards = sorted(set(json.loads(index.read_text()).get("weight_map", {}).values()))
            missing = [shard for shard in shards if not (folder / shard).is_file()]
            if missing:
                return (f"lacks {len(missing)} of the {len(shards)} weight shards {index_name} names "
                        f"({missing[0]}, ...): a partial download or copy")
            return None
    if (folder / "model.safetensors").is_file() or pickled and (folder / "pytorch_model.bin").is_file():
        return None
    if pickled:
        return ("has no weights file (model.safetensors, or model-*-of-*.safetensors with "
                "model.safetensors.index.json, or pytorch_model.bin)")
    return ("has no safetensors weights (model.safetensors or model-*-of-*.safetensors): streamrl loads only "
            "safetensors from the Hub, never pickled .bin weights")
