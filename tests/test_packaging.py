"""One import name per module: ``partitioner/`` and ``kernels/`` install as ``hethub.partitioner`` and
``hethub.kernels`` through setuptools' package_dir, never as top-level packages or symlinks."""
import os
import re
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT

SOURCES = ("hethub", "partitioner", "kernels", "tests", "benchmarks", "examples")


def test_no_symlinks_and_no_top_level_imports_of_the_mapped_packages():
    bad = re.compile(r"^\s*(from|import)\s+(partitioner|kernels)\b", re.M)
    for top in SOURCES:
        for dirpath, _, files in os.walk(os.path.join(ROOT, top)):
            assert not os.path.islink(dirpath), dirpath
            for name in files:
                path = os.path.join(dirpath, name)
                assert not os.path.islink(path), path
                if name.endswith(".py"):
                    with open(path, encoding="utf-8") as f:
                        assert not bad.search(f.read()), f"{path} imports partitioner/kernels top-level"


@pytest.mark.slow
def test_non_editable_install_plans(tmp_path):
    """``pip install .`` (not -e) gives a package whose ``hethub plan`` runs away from the source tree."""
    target, src = tmp_path / "site", tmp_path / "src"  # built from a copy: no build/ left in the checkout
    src.mkdir()
    for name in ("setup.py", "README.md"):
        shutil.copy(os.path.join(ROOT, name), src)
    for name in ("hethub", "partitioner", "kernels"):
        shutil.copytree(os.path.join(ROOT, name), src / name, ignore=shutil.ignore_patterns("__pycache__"))
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                        "--target", str(target), str(src)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert (target / "hethub" / "partitioner" / "planner.py").is_file()
    assert (target / "hethub" / "kernels" / "pack.py").is_file()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(target)
    code = ("import sys, hethub, hethub.partitioner as p; assert hethub.__file__.startswith(sys.argv[1]), "
            "hethub.__file__; assert p.__file__.startswith(sys.argv[1]), p.__file__; "
            "from hethub.cli import main; sys.exit(main(sys.argv[2:]))")
    out = tmp_path / "plan.json"
    r = subprocess.run([sys.executable, "-c", code, str(target), "plan", "--cluster",
                        os.path.join(ROOT, "examples", "cluster.yaml"), "--model", "gpt-1.3b", "--global-batch", "64",
                        "--time-limit", "10", "--no-compare", "-o", str(out)],
                       capture_output=True, text=True, timeout=300, cwd=str(tmp_path), env=env)
    assert r.returncode == 0, r.stdout[-1000:] + r.stderr[-2000:]
    assert out.is_file()
