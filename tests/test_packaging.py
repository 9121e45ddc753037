"""What ``pip install .`` ships. The suite runs on an editable install,
which reads files straight from the checkout, so a file the package needs
but the wheel leaves out (``flowreduce.yaml`` once did: the README's
``pip install ".[viz]" && flowreduce bench`` then failed on import) is
seen only here."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_the_wheel_ships_every_file_of_the_package(tmp_path):
    pytest.importorskip("setuptools", reason="building the wheel needs setuptools")
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True)
    if tracked.returncode != 0:
        pytest.skip(f"not a git checkout: {tracked.stderr.strip()}")
    # built from a copy of the tracked files: setuptools' build/ cache in the checkout would hide a
    # file the configuration leaves out, and the build leaves nothing in the checkout
    source, wheels = tmp_path / "source", tmp_path / "wheels"
    for name in tracked.stdout.splitlines():
        if (REPO / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, source / name)
    # offline: the build backend installed here, no isolated build environment to download
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(wheels), str(source)], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = wheels.glob("flowreduce-*.whl")
    shipped = set(zipfile.ZipFile(wheel).namelist())
    package = {n for n in tracked.stdout.splitlines() if n.startswith("flowreduce/")}
    missing = sorted(package - shipped)
    assert not missing, f"files of the package the wheel leaves out: {missing}"
