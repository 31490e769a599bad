"""The sandbox: reward functions (operators/stages/reward.py) and tools (operators/environments/environment.py) run by name
in a child process, so that one that hangs, crashes or runs away costs its call, not the job.

What the child gets (see `SandboxLimits`):
- a session of its own: a timeout or close SIGKILLs its whole process group, grandchildren too;
- rlimits set before any user code: address space, CPU seconds, file size, no core dumps, and the
  number of processes where the child has a user namespace of its own (see `_apply_limits`);
- an environment of allow-listed variables only: secrets of the parent (MLFLOW_TRACKING_TOKEN,
  AWS_*, HF_TOKEN) never reach it, not even in /proc/<child>/environ;
- its replies are JSON, capped in size: the parent never unpickles what the child sends;
- where bubblewrap works, a read-only filesystem with a private /tmp and no network; else no network
  where the machine lets an unprivileged process make a user and a network namespace (`unshare -rn`):
  operators/environments/isolation.py, detected once per process.

It is not a security boundary against a determined attacker: the child reads what the job's user can read
(without bubblewrap or the namespaces, /proc/<parent>/environ too: the secrets), and a kernel exploit
escapes any of this. Run untrusted code in a container or gVisor.
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing.util
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection

from operators.environments.isolation import PRIVATE, child_prefix, isolation, uses_bwrap

# Variables the child keeps (and any LC_*): what Python, locales and temp files need, nothing secret.
ENV_ALLOW = ("PATH", "HOME", "LANG", "TZ", "PYTHONPATH", "PYTHONHASHSEED", "TMPDIR", "LD_LIBRARY_PATH")
# One BLAS/OpenMP thread: the child serves one call at a time, and every thread's stack and buffers
# count against the address-space limit (on a 100-core node, enough to fail numpy's import).
ENV_SET = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}

# kind -> (resolve 'module:function' of a name, run 'module:function' (fn, first, kwargs) -> JSON value).
# Strings, so this module imports neither operators.stages.reward nor operators.environments.environment.
KINDS = {
    "reward": ("operators.stages.reward:resolve_reward_function", "operators.stages.reward_calls:sandbox_scores"),
    "tool": ("operators.environments.environment:resolve_tool", "operators.environments.environment:sandbox_tool_result"),
}

_GIB, _MIB = 1 << 30, 1 << 20


@dataclass(frozen=True)
class SandboxLimits:
    """What a sandbox child may use. 0 for a limit: not set."""

    address_space_bytes: int = 4 * _GIB  # RLIMIT_AS: a function that allocates past it gets MemoryError
    cpu_seconds: int = 3600  # RLIMIT_CPU over the child's life; the parent replaces it at half of this
    file_size_bytes: int = 64 * _MIB  # RLIMIT_FSIZE: a larger write fails with EFBIG
    max_processes: int = 128  # RLIMIT_NPROC, threads included; only in the child's own user namespace
    max_reply_bytes: int = 8 * _MIB  # a larger reply fails its call
    isolate_network: bool = True  # no network, where `unshare -rn` is permitted
    pass_env: tuple[str, ...] = ()  # more variables the child keeps, e.g. an API key a judge needs

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.type == "int" and (not isinstance(value, int) or value < 0):
                raise ValueError(f"SandboxLimits.{field.name}: a whole number >= 0 (0: no limit), got {value!r}")
        if self.max_reply_bytes < 1024:
            raise ValueError(f"SandboxLimits.max_reply_bytes: at least 1024, got {self.max_reply_bytes}")


_reported: set[str] = set()
_reported_lock = threading.Lock()


def _report_once(line: str) -> None:
    with _reported_lock:
        if line not in _reported:
            _reported.add(line)
            print(line, file=sys.stderr, flush=True)


def child_env(pass_env: Sequence[str] = ()) -> dict[str, str]:
    """The child's environment: the allow-list (and `pass_env`) from this process's, plus ENV_SET."""
    keep = set(ENV_ALLOW) | set(pass_env)
    env = {key: value for key, value in os.environ.items() if key in keep or key.startswith("LC_")}
    return {**env, **ENV_SET}


# --- the child ------------------------------------------------------------------------------------


def _die_with_parent(parent_pid: int | None) -> None:
    """Exit when the parent goes away, even in the middle of a hung call (a Ray actor may be
    SIGKILLed, which runs no cleanup): the kernel's parent-death signal on Linux, and a thread
    that polls the parent pid everywhere. `parent_pid` None: the parent is bwrap, which dies with the
    actor (--die-with-parent) and whose pid the actor did not know when it wrote the spec."""
    parent_pid = os.getppid() if parent_pid is None else parent_pid
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(1)

    if os.getppid() != parent_pid:
        os._exit(1)
    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _apply_limits(limits: SandboxLimits, own_user_namespace: bool) -> None:
    """Hard and soft limits alike, so code in the child cannot raise them again."""
    import resource

    def limit(which: int, value: int) -> None:
        if value:
            resource.setrlimit(which, (value, value))

    limit(resource.RLIMIT_AS, limits.address_space_bytes)
    limit(resource.RLIMIT_CPU, limits.cpu_seconds)
    limit(resource.RLIMIT_FSIZE, limits.file_size_bytes)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    # RLIMIT_NPROC counts every process and thread of the uid: outside a user namespace of its own that
    # is the whole job's (Ray workers' threads run into the thousands), so a sandbox-sized limit would
    # break the child's own threads. Inside one, the kernel counts the namespace's tasks only.
    if own_user_namespace:
        limit(resource.RLIMIT_NPROC, limits.max_processes)
    # A write past the file size limit raises OSError (EFBIG) in the function instead of killing the child.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)


def _import(path: str):
    import importlib

    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


def _send(conn: Connection, reply: dict) -> None:
    """JSON, never pickle: the parent must not run code the child chose. NaN and infinities are refused
    (strict JSON); a result that cannot be encoded is the call's error."""
    try:
        data = json.dumps(reply, allow_nan=False).encode()
    except (TypeError, ValueError) as err:
        data = json.dumps({"error": f"the result cannot be sent as JSON ({type(err).__name__}: {err})",
                           "cpu_s": reply.get("cpu_s", 0.0)}).encode()
    conn.send_bytes(data)


def child_main(spec: dict) -> None:
    """The child: limits first, then resolve the functions once, then answer each call."""
    limits = SandboxLimits(**{**spec["limits"], "pass_env": tuple(spec["limits"]["pass_env"])})
    _apply_limits(limits, spec["own_user_namespace"])
    _die_with_parent(spec["parent_pid"])
    conn = Connection(spec["fd"])
    resolve_path, run_path = KINDS[spec["kind"]]
    try:
        resolve, run = _import(resolve_path), _import(run_path)
        functions = {name: resolve(name) for name in spec["names"]}
    except Exception as err:  # noqa: BLE001 - reported to the parent
        _send(conn, {"error": f"{type(err).__name__}: {err}"})
        return
    _send(conn, {"ready": os.getpid()})
    while True:
        try:
            # Calls come pickled from the parent, which is trusted; only replies must not be.
            name, first, kwargs = conn.recv()
        except (EOFError, OSError):
            return  # the parent closed the pipe: done
        try:
            reply = {"ok": run(functions[name], first, kwargs)}
        except Exception as err:  # noqa: BLE001 - reported to the parent
            reply = {"error": f"{type(err).__name__}: {err}"}
        usage = os.times()
        reply["cpu_s"] = usage.user + usage.system
        _send(conn, reply)


# The child's whole command line: the parent's sys.path, then child_main. No multiprocessing "spawn":
# it cannot give the child its own environment, session or namespace, and re-imports the parent's
# __main__ (a user's script, or Ray's worker).
_BOOT = "import json, sys; spec = json.loads(sys.argv[1]); sys.path[:] = spec['sys_path']; " \
        "from operators.environments.sandbox import child_main; child_main(spec)"


# --- the parent -----------------------------------------------------------------------------------


def _stop_process(process: subprocess.Popen, conn: Connection) -> None:
    """SIGKILL the child's whole process group (a hung function gets no chance to block it, and its
    own children die with it) and reap the child."""
    try:
        conn.close()
    except OSError:
        pass
    try:
        os.killpg(process.pid, signal.SIGKILL)  # the child leads its session: its pgid is its pid
    except (ProcessLookupError, PermissionError):
        pass  # the group is gone already
    try:
        process.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass


class Sandbox:
    """One child process that runs functions of one `kind` ("reward" or "tool", see KINDS) by their
    names, started lazily and reused across calls. `call` gives up on a call after `timeout_s`: the
    child's process group is killed and the next call starts a new child. The child is killed when
    this object is collected or the process exits, and exits by itself when its parent dies."""

    def __init__(self, names: Sequence[str], kind: str = "reward", limits: SandboxLimits = SandboxLimits(),
                 start_timeout_s: float = 120.0):
        if kind not in KINDS:
            raise ValueError(f"sandbox kind {kind!r}: one of {sorted(KINDS)}")
        self.names = list(names)
        self.kind = kind
        self.limits = limits
        self.start_timeout_s = start_timeout_s
        self.process: subprocess.Popen | None = None
        self._conn: Connection | None = None
        self._finalizer = None
        self.starts = 0
        # One call at a time on the pipe: Reward may be called from several threads (in a threaded
        # generate actor, reward.placement "generate" with the in-flight engine).
        self._lock = threading.Lock()
        # The child is started from a thread of its own that lives as long as this object: Linux sends the
        # parent-death signal when the *thread* that forked the child exits, and a calling thread may be
        # short-lived (measured: children started from finished threads were SIGKILLed mid-call).
        self._starter = None
        self._child_pid: int | None = None

    @property
    def pid(self) -> int | None:
        """The pid of the process that runs the functions (under bwrap, bwrap's child, not `process`)."""
        return self._child_pid if self.process is not None and self.process.poll() is None else None

    def _start(self) -> None:
        prefix, line = isolation(self.limits.isolate_network)
        if self.limits.isolate_network and not prefix:
            # Less isolation than asked for, on this actor's node: that is the user's to know, from here. The
            # full line, what the sandbox protects, the job's driver says once (pipelines/job.py).
            _report_once(line)
        bwrap = uses_bwrap(prefix)
        parent_sock, child_sock = socket.socketpair()
        spec = {
            "fd": child_sock.fileno(), "names": self.names, "kind": self.kind,
            "parent_pid": None if bwrap else os.getpid(), "sys_path": sys.path,
            "limits": dataclasses.asdict(self.limits), "own_user_namespace": bool(prefix),
        }
        env = child_env(self.limits.pass_env)
        if bwrap:
            # Only the private /tmp is writable: temporary files go there whatever TMPDIR says here, and so do
            # matplotlib's config and cache (reasoning-gym imports it), which would warn at every start that its
            # folder under HOME is read-only.
            env["TMPDIR"] = PRIVATE
            env.setdefault("MPLCONFIGDIR", f"{PRIVATE}/matplotlib")
        try:
            # bwrap passes the pipe's descriptor on to its child; it stays in the new session with it, so
            # the kill of the session's process group reaches both.
            process = subprocess.Popen(
                [*child_prefix(prefix), sys.executable, "-c", _BOOT, json.dumps(spec)], env=env,
                pass_fds=(child_sock.fileno(),), start_new_session=True, stdin=subprocess.DEVNULL,
            )
        finally:
            child_sock.close()
        conn = Connection(parent_sock.detach())
        # Runs when this object is collected, and at exit (multiprocessing's exit hook).
        self._finalizer = multiprocessing.util.Finalize(self, _stop_process, args=(process, conn), exitpriority=10)
        self.process, self._conn = process, conn
        self.starts += 1
        reply, problem = self._receive(self.start_timeout_s)
        if problem == "timeout":
            raise RuntimeError(f"the {self.kind} sandbox process did not start within {self.start_timeout_s:g}s")
        if problem is not None:
            self.close()
            raise RuntimeError(f"the {self.kind} sandbox process could not start: {problem}")
        if "ready" not in reply:
            self.close()
            raise RuntimeError(f"the {self.kind} sandbox cannot load the {self.kind} functions {self.names}: "
                               f"{reply.get('error')}")
        self._child_pid = reply["ready"] if isinstance(reply["ready"], int) else None

    def close(self) -> None:
        if self._finalizer is not None:
            self._finalizer()  # runs _stop_process once
        self.process = self._conn = self._finalizer = self._child_pid = None

    def _receive(self, timeout_s: float) -> tuple[dict | None, str | None]:
        """(the child's reply, None), or (None, what went wrong); the child is stopped on any problem."""
        if not self._conn.poll(timeout_s):
            self.close()  # SIGKILL; the next call starts a fresh child
            return None, "timeout"
        try:
            data = self._conn.recv_bytes(self.limits.max_reply_bytes)
        except EOFError:
            try:
                code = self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:  # it closed its end of the pipe but lives on
                code = None
            self.close()
            return None, f"the sandbox process died (exit code {code})"
        except OSError as err:  # "bad message length": over the cap; the rest of it is still in the pipe
            self.close()
            return None, (f"could not read the sandbox's reply ({err}; replies are capped at "
                          f"{self.limits.max_reply_bytes} bytes, SandboxLimits.max_reply_bytes)")
        try:
            reply = json.loads(data, parse_constant=_refuse_constant)
        except ValueError as err:
            self.close()
            return None, f"the sandbox's reply is not JSON ({err})"
        if not isinstance(reply, dict) or not reply.keys() & {"ok", "error", "ready"}:
            self.close()
            return None, "the sandbox's reply is not one of its own"
        return reply, None

    def call(self, name: str, first: list, kwargs: dict, timeout_s: float):
        """(the function's JSON result, None), or (None, 'timeout'), or (None, what went wrong)."""
        with self._lock:
            return self._call(name, first, kwargs, timeout_s)

    def _call(self, name: str, first: list, kwargs: dict, timeout_s: float):
        if self.process is None or self.process.poll() is not None:
            self.close()
            if self._starter is None:
                from concurrent.futures import ThreadPoolExecutor

                self._starter = ThreadPoolExecutor(1, thread_name_prefix=f"streamrl-{self.kind}-sandbox")
            self._starter.submit(self._start).result()
        try:
            self._conn.send((name, first, kwargs))
        except (OSError, ValueError) as err:  # BrokenPipeError: the child died between calls
            self.close()
            return None, f"could not send the call to the sandbox process ({type(err).__name__}: {err})"
        reply, problem = self._receive(timeout_s)
        if problem is not None:
            return None, problem
        if not isinstance(reply.get("cpu_s"), (int, float)) or reply["cpu_s"] > self.limits.cpu_seconds / 2 > 0:
            self.close()  # replaced before its CPU limit can kill it in the middle of a later call
        if "error" in reply:
            return None, str(reply["error"])
        return reply["ok"], None


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not JSON")
