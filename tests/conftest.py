import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
DATA = os.path.join(ROOT, "tests", "data")


@pytest.fixture
def example_plan_path() -> str:
    return os.path.join(EXAMPLES, "plan.json")


def run_cli(*args: str, timeout: float = 120, env: dict | None = None):
    """Run ``python -m hethub.cli`` in a fresh interpreter; returns CompletedProcess."""
    import subprocess
    e = dict(os.environ)
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "hethub.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=e)
