"""The SDK and its tests type-check under ``mypy --strict``."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import aviary


def test_mypy_strict() -> None:
    mypy = shutil.which("mypy", path=os.path.dirname(sys.executable))
    assert mypy, "mypy is installed next to pytest (the test venv pins it)"
    pkg = Path(aviary.__file__).parent
    tests = Path(__file__).parent
    out = subprocess.run(
        [mypy, "--strict", "--no-incremental", str(pkg), str(tests)],
        capture_output=True,
        text=True,
        cwd=tests.parent,
    )
    assert out.returncode == 0, out.stdout + out.stderr
