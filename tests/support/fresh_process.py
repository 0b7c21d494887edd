"""Run a test's script in a fresh Python process and read its one ``RESULT`` line.

For what a test runner's own process cannot show: a first ``ray.init`` of a process,
a process without children. The script prints ``RESULT <json>`` once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def run_script(script: str, timeout_s: float = 300) -> tuple[Any, str]:
    """(the script's RESULT, its stdout + stderr); fails the test on a non-zero exit."""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=timeout_s, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr[-3000:]
    [line] = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    return json.loads(line.removeprefix("RESULT ")), done.stdout + done.stderr
