import os
import shutil
import sys

import pytest

# No GPU here: Triton kernels run on CPU tensors through its interpreter (must be set before triton.jit runs).
# A GPU's driver shows as /dev/nvidiactl (NVIDIA, also in containers without nvidia-smi) or /dev/kfd (AMD); the
# device check (HETHUB_REQUIRE_GPU=1) never falls back to the interpreter, so its GPU tests run compiled or fail.
_NO_GPU = (shutil.which("nvidia-smi") is None and not os.path.exists("/dev/nvidiactl")
           and not os.path.exists("/dev/kfd"))
if _NO_GPU and os.environ.get("HETHUB_REQUIRE_GPU") != "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
DATA = os.path.join(ROOT, "tests", "data")
# Every Python the tests start skips DeepSpeed's CPU shared-memory op (``tests/site/sitecustomize.py`` says why).
SITE = os.path.join(ROOT, "tests", "site")
if SITE not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (SITE, os.environ.get("PYTHONPATH")) if p)


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
