"""The code passes `ruff check` with the repository's ruff.toml (its style: 2-space indentation, 120
columns, pyflakes' errors: unused imports and names, undefined names)."""

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_ruff_check_passes():
  result = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "."], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
  assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-2000:]
