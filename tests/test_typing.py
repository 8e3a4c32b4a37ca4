"""Public names as a type checker sees them in a user's code (the package ships py.typed)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_user_code_type_checks_as_the_readme_writes_it_and_its_mistakes_do_not(
    tmp_path: Path,
) -> None:
    # A step.appended listener's event.step was Step | None (the README's own
    # listener failed mypy --strict); the tasks, a module __getattr__ and
    # from_settings' overrides were Any, so wrong arguments and misspelt names passed.
    source = ROOT / "tests" / "support" / "user_code.py"
    expected = {
        (number, match.group(1))
        for number, line in enumerate(source.read_text().splitlines(), 1)
        if (match := re.search(r"# error: ([a-z-]+)$", line))
    }
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--config-file",
            str(ROOT / "pyproject.toml"),
            "--strict",
            "--cache-dir",
            str(tmp_path / "cache"),
            "--no-error-summary",
            str(source),
        ],
        cwd=tmp_path,
        env={**os.environ, "MYPYPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    found = {
        (int(number), code)
        for number, code in re.findall(
            r"user_code\.py:(\d+): error: .*\[([a-z-]+)\]$", result.stdout, re.MULTILINE
        )
    }
    assert found == expected, result.stdout + result.stderr
