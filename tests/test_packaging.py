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


def _import_kernels_from_the_checkout(tmp_path, *flags, pythonpath=""):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    code = "import kernels, kernels.sub; print(kernels.MARK, kernels.sub.MARK)"
    return subprocess.run([sys.executable, *flags, "-c", code], capture_output=True, text=True, timeout=60,
                          cwd=ROOT, env=env)  # -c from the root: '' (the checkout) leads sys.path


def test_the_checkout_root_on_sys_path_does_not_shadow_another_kernels_package(tmp_path):
    """transformers >= 5.25 imports Hugging Face's ``kernels`` and every setuptools build loads its entry point;
    run from the checkout (``python -m pytest``, ``pip install .``) the room ``kernels/`` sits first on sys.path
    and must hand the name over, submodules included, or fail as a missing module."""
    other = tmp_path / "kernels"
    other.mkdir()
    (other / "__init__.py").write_text("MARK = 'other'\n")
    (other / "sub.py").write_text("MARK = 'other.sub'\n")
    r = _import_kernels_from_the_checkout(tmp_path, pythonpath=str(tmp_path))
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["other", "other.sub"]
    r = _import_kernels_from_the_checkout(tmp_path, "-S")  # no site-packages: no other kernels anywhere
    assert r.returncode == 1 and "ModuleNotFoundError: No module named 'kernels'" in r.stderr, r.stderr[-2000:]
