"""The sandbox (operators/environments/sandbox.py) contains what a reward function or tool does in its child: its own
children, secrets in the environment, memory and disk, oversized or pickled replies, and, where the
machine permits it, the network and (with bubblewrap) writes outside a private /tmp. Real child processes,
functions from tests/reward_fixtures.py."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pandas as pd
import pytest

from operators.environments.environment import ToolEnvironment
from operators.stages.reward import Reward
from operators.environments.isolation import APPLIES, bubblewrap, uses_bwrap
from operators.environments.sandbox import Sandbox, SandboxLimits, isolation


def batch(responses: list[str], **columns) -> pd.DataFrame:
    """One prompt group with `responses`, and `columns` as dataset columns."""
    return pd.DataFrame({"prompt_id": ["p0"], "prompt": ["x"], "answer": ["1"], "responses": [responses],
                         **{name: [value] for name, value in columns.items()}})


def gone(pid: int) -> bool:
    """The process has exited (a zombie waiting for a reaper counts as exited)."""
    try:
        return "\nState:\tZ" in Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True


def wait_gone(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not gone(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return gone(pid)


def test_timeout_kills_the_functions_own_children(capfd):
    reward = Reward([("reward_fixtures:start_sleeper_and_hang", 1.0)], on_error=-1.0, timeout_s=2)
    try:
        out = reward(batch(["1"]))
        assert out["rewards"].tolist() == [[-1.0]] and out["reward_timeouts"].tolist() == [1]
        sleeper = int(re.search(r"sleeper pid (\d+)", capfd.readouterr().err).group(1))
        assert wait_gone(sleeper, 5), f"the sandbox's grandchild {sleeper} outlived the timeout"
    finally:
        reward.close()


def test_secrets_in_the_environment_do_not_reach_the_child(monkeypatch):
    monkeypatch.setenv("STREAMRL_TEST_SECRET", "hunter2")
    scrubbed = Reward([("reward_fixtures:sees_test_secret", 1.0)], timeout_s=10)
    passed = Reward([("reward_fixtures:sees_test_secret", 1.0)], timeout_s=10,
                    limits=SandboxLimits(pass_env=("STREAMRL_TEST_SECRET",)))
    try:
        assert scrubbed(batch(["1"]))["rewards"].tolist() == [[0.0]]  # neither os.environ nor /proc/self/environ
        assert passed(batch(["1"]))["rewards"].tolist() == [[1.0]]  # unless the limits name it
    finally:
        scrubbed.close()
        passed.close()


def test_the_sandbox_section_of_a_config_sets_the_limits_a_job_passes(monkeypatch):
    """`sandbox:` in a config reaches the reward functions' child (what grpo and eval build Reward with) and
    the builtin tool environment's options."""
    from pipelines.config.load import load_config
    from pipelines.runtime.rollout_settings import environment_options, sandbox_limits

    cfg = load_config("configs/tiny_tools.yaml", ["sandbox.pass_env=[STREAMRL_TEST_SECRET]", "sandbox.network=true",
                                                  "sandbox.memory_mb=2048", "sandbox.max_reply_mb=1"])
    limits = sandbox_limits(cfg.sandbox)
    assert limits == SandboxLimits(address_space_bytes=2 << 30, max_reply_bytes=1 << 20, isolate_network=False,
                                   pass_env=("STREAMRL_TEST_SECRET",))
    assert environment_options(cfg)["limits"] == limits
    monkeypatch.setenv("STREAMRL_TEST_SECRET", "hunter2")
    reward = Reward([("reward_fixtures:sees_test_secret", 1.0)], timeout_s=10, limits=limits)
    try:
        assert reward(batch(["1"]))["rewards"].tolist() == [[1.0]]
    finally:
        reward.close()


def test_memory_past_the_limit_fails_the_call_and_the_child_serves_the_next():
    reward = Reward([("reward_fixtures:allocate_two_gib", 1.0), ("arithmetic_exact", 10.0)], on_error=-1.0,
                    timeout_s=30, limits=SandboxLimits(address_space_bytes=1 << 30))
    try:
        out = reward(batch(["1", "2"]))
        assert out["reward_reward_fixtures.allocate_two_gib"].tolist() == [[-1.0, -1.0]]  # MemoryError
        assert out["reward_errors"].tolist() == [2] and out["reward_timeouts"].tolist() == [0]
        assert out["reward_arithmetic_exact"].tolist() == [[1.0, 0.0]]  # the same child, after it
        child = reward.sandbox.pid
        assert reward(batch(["1"]))["reward_arithmetic_exact"].tolist() == [[1.0]]
        assert reward.sandbox.pid == child and reward.sandbox.starts == 1
    finally:
        reward.close()


def test_writes_past_the_file_size_limit_fail_the_call(capfd):
    reward = Reward([("reward_fixtures:write_two_mib", 1.0)], on_error=-1.0, timeout_s=10,
                    limits=SandboxLimits(file_size_bytes=1 << 20))
    try:
        out = reward(batch(["1"], tmp_name=f"streamrl-fsize-{uuid.uuid4().hex}"))
        assert out["rewards"].tolist() == [[-1.0]] and out["reward_errors"].tolist() == [1]
        assert f"write_two_mib: {1 << 20} bytes" in capfd.readouterr().err  # cut at the limit (EFBIG)
        assert reward.sandbox.pid is not None  # the child alive
    finally:
        reward.close()


def test_an_oversized_reply_fails_its_call_only():
    tools = ToolEnvironment(tools=("reward_fixtures:huge_tool", "reward_fixtures:echo_tool"), sandboxes=1)
    result, error = tools.call("reward_fixtures:huge_tool", "")
    assert result is None and "capped at 8388608 bytes" in error
    assert tools.call("reward_fixtures:echo_tool", "abc") == ("cba", None)  # a fresh child answers


def test_the_parent_never_unpickles_what_the_child_sends(tmp_path, capfd):
    marker = tmp_path / "ran-in-the-parent"
    reward = Reward([("reward_fixtures:pickle_into_pipe", 1.0)], on_error=-1.0, timeout_s=10)
    try:
        out = reward(batch(["1"], marker=str(marker)))
        assert out["rewards"].tolist() == [[-1.0]] and out["reward_errors"].tolist() == [1]
        assert "reply is not JSON" in capfd.readouterr().err
    finally:
        reward.close()
    assert not marker.exists()
    # A tool's string subclass with its own pickle arrives as its text, nothing more.
    tool_marker = tmp_path / "tool-ran-in-the-parent"
    tools = ToolEnvironment(tools=("reward_fixtures:unpickle_trap_tool",), sandboxes=1)
    assert tools.call("reward_fixtures:unpickle_trap_tool", str(tool_marker)) == (str(tool_marker), None)
    assert not tool_marker.exists()


def test_reply_scores_round_trip_through_json():
    """Finite scores arrive exactly (1e308 too: its fate is the trainer's to decide); failed samples (None,
    NaN, infinities, not numbers) arrive as failures, as in the function's own process."""
    sandbox = Sandbox(["reward_fixtures:none_for_empty"], "reward")
    try:
        reply, problem = sandbox.call("reward_fixtures:none_for_empty", ["a", "", "b"], {"answer": ["a", "x", "c"]}, 10)
        # it raised on no sample; sample 1 is the one it returned None for
        assert problem is None and reply == {"scores": [1.0, None, 0.0], "none": [1], "raised": None}
    finally:
        sandbox.close()
    reward = Reward([("reward_fixtures:troublemaker", 1.0)], on_error=-1.0, timeout_s=10)
    try:
        out = reward(pd.DataFrame({"prompt_id": ["arith-00007"], "prompt": ["x"], "answer": ["2"],
                                   "responses": [["2", "3"]]}))
        assert out["rewards"].tolist() == [[1e308, 0.0]]
    finally:
        reward.close()


def test_isolation_is_what_this_machine_permits():
    prefix, line = isolation(True)
    bwrap, unshare = shutil.which("bwrap"), shutil.which("unshare")
    bwrap_works = bwrap is not None and subprocess.run(
        [bwrap, "--unshare-user", "--unshare-net", "--ro-bind", "/", "/", "--tmpfs", "/tmp", "true"],
        capture_output=True).returncode == 0
    unshare_works = unshare is not None and subprocess.run([unshare, "-rn", "true"], capture_output=True).returncode == 0
    assert uses_bwrap(prefix) == bwrap_works and bool(prefix) == (bwrap_works or unshare_works)
    if bwrap_works:
        assert "no network, a read-only filesystem with a private /tmp (bubblewrap)" in line
    elif unshare_works:
        assert "no network (own user and network namespace" in line and "no filesystem isolation (" in line
    else:
        assert "no network or filesystem isolation on this machine" in line
    assert line.endswith(APPLIES)
    reward = Reward([("reward_fixtures:network_interfaces", 1.0)], timeout_s=10)
    try:
        seen = reward(batch(["1"]))["rewards"].iloc[0][0]
    finally:
        reward.close()
    if prefix:
        assert seen == 0.0  # loopback only
    allowed_prefix, allowed_line = isolation(False)
    assert "network allowed" in allowed_line and "--unshare-net" not in allowed_prefix
    assert uses_bwrap(allowed_prefix) == bwrap_works  # files stay isolated when the network is allowed


def bwrap_or_skip() -> None:
    prefix, problem = bubblewrap(True)
    if not prefix:
        pytest.skip(f"no bubblewrap isolation on this machine ({problem})")


def test_under_bubblewrap_the_child_writes_only_its_private_tmp(tmp_path):
    bwrap_or_skip()
    outside = Path(tempfile.mkdtemp(prefix="streamrl-sandbox-", dir="/var/tmp" if os.access("/var/tmp", os.W_OK)
                                    else Path.home()))  # writable here, outside /tmp
    private = Path("/tmp") / f"streamrl-private-{uuid.uuid4().hex}"
    targets = [outside / "escaped", private, tmp_path / "escaped"]
    reward = Reward([("reward_fixtures:writes", 1.0)], timeout_s=60)
    try:
        assert reward(batch([str(t) for t in targets]))["rewards"].tolist() == [[0.0, 1.0, 0.0]]
        assert not any(t.exists() for t in targets)  # the one write that worked went to the child's own /tmp
    finally:
        reward.close()
        shutil.rmtree(outside)
        private.unlink(missing_ok=True)


def test_bwrap_binds_back_the_folders_of_modules_imported_without_a_sys_path_entry(tmp_path, monkeypatch):
    """An editable install resolves its packages through an import hook: a checkout under /tmp has no sys.path
    entry, and the child saw no `operators` there (ModuleNotFoundError in a fresh clone under /tmp)."""
    import importlib.util

    from operators.environments.isolation import code_binds, import_roots

    package = tmp_path / "hooked" / "hooked_pkg"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    spec = importlib.util.spec_from_file_location("hooked_pkg", package / "__init__.py")
    monkeypatch.setitem(sys.modules, "hooked_pkg", importlib.util.module_from_spec(spec))
    assert str(package.parent) not in sys.path and str(package.parent) in import_roots()
    binds = code_binds()
    assert any(binds[i:i + 3] == ["--ro-bind", str(package.parent), str(package.parent)] for i in range(len(binds)))


def test_under_bubblewrap_the_child_cannot_reach_the_loopback():
    bwrap_or_skip()
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    isolated = Reward([("reward_fixtures:connects", 1.0)], timeout_s=60)
    allowed = Reward([("reward_fixtures:connects", 1.0)], timeout_s=60, limits=SandboxLimits(isolate_network=False))
    try:
        assert isolated(batch(["1"], port=port))["rewards"].tolist() == [[0.0]]
        # The same call with the network allowed reaches the server: what failed above was the network.
        assert allowed(batch(["1"], port=port))["rewards"].tolist() == [[1.0]]
    finally:
        isolated.close()
        allowed.close()
        server.close()


def test_limits_are_checked():
    with pytest.raises(ValueError, match="address_space_bytes: a whole number >= 0"):
        SandboxLimits(address_space_bytes=-1)
    with pytest.raises(ValueError, match="max_reply_bytes: at least 1024"):
        SandboxLimits(max_reply_bytes=10)
    with pytest.raises(ValueError, match="sandbox kind 'judge'"):
        Sandbox(["x"], "judge")

