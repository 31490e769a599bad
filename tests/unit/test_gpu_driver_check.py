"""`make install-gpu` first runs scripts/check_gpu_driver.py: a driver older than the lock's CUDA
release needs is refused with what to do (issue 26, 4c). Driver strings are fed as nvidia-smi
prints them; the script runs as the Makefile runs it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def check(lock: Path, driver: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "check_gpu_driver.py"), str(lock), "--driver", driver],
                          capture_output=True, text=True, check=False)


def test_the_makefile_runs_the_check_on_the_gpu_lock():
    makefile = (ROOT / "Makefile").read_text()
    recipe = makefile.split("\ninstall-gpu:\n", 1)[1].split("\n\n", 1)[0]
    first = recipe.splitlines()[0]
    assert "scripts/check_gpu_driver.py constraints-gpu.txt" in first and "DRIVER_CHECK" in first
    assert "cuda-toolkit==13." in (ROOT / "constraints-gpu.txt").read_text()  # the lock the check reads


@pytest.mark.parametrize("driver", ["535.104.05", "550.54.15", "570.86.15"])
def test_a_driver_older_than_580_is_refused_for_cuda_13_with_the_fix(driver):
    result = check(ROOT / "constraints-gpu.txt", driver)
    assert result.returncode == 2
    assert f"the NVIDIA driver is {driver}" in result.stderr and "CUDA 13.0 build" in result.stderr
    assert "needs driver 580 or newer" in result.stderr and "make install-gpu DRIVER_CHECK=0" in result.stderr


@pytest.mark.parametrize("driver", ["580.65", "580.65.06", "595.12"])
def test_a_580_driver_or_newer_is_accepted(driver):
    result = check(ROOT / "constraints-gpu.txt", driver)
    assert result.returncode == 0, result.stderr
    assert f"NVIDIA driver {driver} runs CUDA 13.0" in result.stderr


def test_the_minimum_follows_the_lock_cuda_release(tmp_path):
    """A lock of a CUDA 12 build accepts the 535 driver the CUDA 13 lock refuses; 470 is too old for either."""
    lock = tmp_path / "constraints-cu12.txt"
    lock.write_text("cuda-toolkit==12.8.1\ntorch==2.13.0\n")
    assert check(lock, "535.104.05").returncode == 0
    refused = check(lock, "470.256.02")
    assert refused.returncode == 2 and "needs driver 525 or newer" in refused.stderr


def test_an_unreadable_driver_version_is_refused():
    result = check(ROOT / "constraints-gpu.txt", "NVIDIA-SMI has failed")
    assert result.returncode == 2 and "cannot read the NVIDIA driver version" in result.stderr
