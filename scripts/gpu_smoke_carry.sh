#!/usr/bin/env bash
# Prepares .gpu_carry/ (git-ignored): what benchmarks/gpu_smoke.py needs on the lent GPU machine
# beyond what it has (Python 3.12, CUDA torch, transformers, accelerate, numpy; no Ray, DeepSpeed,
# pydantic). About 30 MB (DeepSpeed's sources are most of it), inside the 64 MiB a device run carries. On that machine:
#   for w in .gpu_carry/wheels/*.whl; do python3 -m zipfile -e "$w" .gpu_carry/py312; done   # a wheel is a zip
#   PYTHONPATH=.gpu_carry/site:.gpu_carry/py312:. DS_ACCELERATOR=cuda python benchmarks/gpu_smoke.py --out $OUT/smoke.json
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PY:-.venv/bin/python}"
OUT=.gpu_carry
SITE="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
version() { "$PY" -c "import importlib.metadata as m; print(m.version('$1'))"; }
rm -rf "$OUT"
mkdir -p "$OUT/wheels" "$OUT/site"
# Compiled packages: their CPython 3.12 wheels, at the versions this venv runs.
"$PY" -m pip download -q -d "$OUT/wheels" --no-deps --python-version 3.12 --only-binary=:all: \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  "pydantic-core==$(version pydantic_core)" "msgpack==$(version msgpack)"
# Pure-Python packages, copied from this venv. DeepSpeed is published as a source archive only;
# its compiled ops are built on first use, and the smoke test uses none (torch's AdamW).
for pkg in deepspeed pydantic hjson cpuinfo einops annotated_types typing_inspection; do
  cp -r "$SITE/$pkg" "$OUT/site/"
done
# DeepSpeed's metadata too: transformers' HfDeepSpeedConfig (ZeRO-3) checks the installed version by it.
cp -r "$SITE"/deepspeed-*.dist-info "$OUT/site/"
EXCLUDE="$(git rev-parse --git-path info/exclude)"
mkdir -p "$(dirname "$EXCLUDE")"
grep -qsx '/.gpu_carry/' "$EXCLUDE" || echo '/.gpu_carry/' >> "$EXCLUDE"
du -sh "$OUT"
