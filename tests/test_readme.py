"""The README's first lines are the commands users copy: keep them true."""
import os
import re

from conftest import ROOT


def _readme_commands():
    text = open(os.path.join(ROOT, "README.md")).read()
    block = re.search(r"```sh\n(.*?)```", text, re.S).group(1).strip().splitlines()
    return block


def test_readme_starts_with_two_commands():
    install_and_run, test_cmd = _readme_commands()
    assert install_and_run.startswith("pip install torch==2.13.0")
    assert "hethub " in install_and_run
    assert "pytest" in test_cmd


def test_ci_runs_the_readme_test_command():
    _, test_cmd = _readme_commands()
    ci = open(os.path.join(ROOT, ".ci", "run")).read().splitlines()
    assert test_cmd in ci
