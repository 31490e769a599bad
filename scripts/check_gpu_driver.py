"""Refuse `make install-gpu` on a machine whose NVIDIA driver is too old for the CUDA build the lock pins.

    python3 scripts/check_gpu_driver.py constraints-gpu.txt              # reads nvidia-smi
    python3 scripts/check_gpu_driver.py constraints-gpu.txt --driver 535.104.05

The CUDA release comes from the lock's `cuda-toolkit==X.Y...` pin (torch's CUDA build brings it);
the oldest driver for each CUDA major release is NVIDIA's minimum for CUDA minor-version
compatibility on Linux (CUDA Toolkit release notes): 12.x needs 525, 13.x needs 580. Exit 0 when
the driver is new enough, or when there is no nvidia-smi to ask (an image built on a machine
without GPUs: nothing to compare); exit 2 with what to do otherwise. Standard library only: it runs
before the venv exists.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from pathlib import Path

MIN_DRIVER = {12: 525, 13: 580}  # CUDA major release -> oldest Linux driver branch (minor-version compatibility)


def lock_cuda(lock: Path) -> str | None:
    """The CUDA release ("13.0") a constraints file pins through cuda-toolkit; None if it pins none."""
    match = re.search(r"^cuda-toolkit==(\d+)\.(\d+)", lock.read_text(), re.MULTILINE)
    return f"{match[1]}.{match[2]}" if match else None


def driver_problem(driver: str, cuda: str) -> str | None:
    """Why driver `driver` (as nvidia-smi prints it, e.g. "535.104.05") cannot run CUDA `cuda`; None if it can."""
    match = re.match(r"\s*(\d+)(?:\.\d+)*\s*$", driver)
    if match is None:
        return f"cannot read the NVIDIA driver version {driver!r} (nvidia-smi --query-gpu=driver_version)"
    major, needs = int(match[1]), MIN_DRIVER.get(int(cuda.split(".")[0]))
    if needs is None or major >= needs:
        return None
    return (f"the NVIDIA driver is {driver.strip()}, but constraints-gpu.txt installs torch's CUDA {cuda} build, "
            f"which needs driver {needs} or newer. Upgrade the driver to the {needs} branch or later, then run "
            "`make install-gpu` again. This project has no CUDA 12 lock: PyPI carries only the CUDA 13 build of "
            "torch 2.13.0 and of vllm 0.32.0; a CUDA 12.8 set (torch 2.13.0 from PyTorch's cu128 index and a "
            "vLLM 0.32.0 built for it, neither on PyPI) would be assembled by hand and is untested here. "
            "To install anyway (e.g. building an image for other machines): make install-gpu DRIVER_CHECK=0")


def installed_driver() -> str | None:
    """The lowest driver version nvidia-smi reports over this machine's GPUs; None without nvidia-smi."""
    if shutil.which("nvidia-smi") is None:
        return None
    out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True, check=False)
    versions = [line.strip() for line in out.stdout.splitlines() if line.strip()]
    if out.returncode != 0 or not versions:
        return f"nvidia-smi failed ({out.returncode}): {out.stderr.strip() or out.stdout.strip()}"
    return min(versions, key=lambda v: [int(part) for part in re.findall(r"\d+", v)] or [0])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("lock", type=Path, help="the constraints file the install uses (constraints-gpu.txt)")
    parser.add_argument("--driver", help="the driver version to check (default: nvidia-smi's)")
    args = parser.parse_args(argv)
    cuda = lock_cuda(args.lock)
    driver = args.driver if args.driver is not None else installed_driver()
    if cuda is None or driver is None:
        print(f"check_gpu_driver: {'no nvidia-smi' if driver is None else f'{args.lock} pins no cuda-toolkit'}; "
              "driver not checked", file=sys.stderr)
        return 0
    problem = driver_problem(driver, cuda)
    if problem:
        print(f"make install-gpu: {problem}", file=sys.stderr)
        return 2
    print(f"check_gpu_driver: NVIDIA driver {driver} runs CUDA {cuda}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
