"""The README's first lines are the commands users copy: keep them true."""
import os
import re

import pytest

from conftest import ROOT
from hethub.partitioner import Plan


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


def _command_rows() -> dict:
    """Each subcommand's sections of the command reference (docs/cli.md), as one text."""
    text = open(os.path.join(ROOT, "docs", "cli.md")).read()
    rows = {}
    for section in re.split(r"\n(?=## )", text):
        if m := re.match(r"## `hethub (\w+)", section):
            rows[m.group(1)] = rows.get(m.group(1), "") + section
    return rows


def _shown(default) -> str:
    return f"{default:g}" if isinstance(default, float) else str(default)


def test_every_flag_and_default_is_in_the_command_reference():
    """Each subcommand's section in docs/cli.md names every long flag --help lists, and every default that is a
    value (not off, not unset); hethub launch's own flags too (DeepSpeed's pass through)."""
    import argparse
    from hethub.cli.launch import OWN_FLAGS
    from hethub.cli.parser import build_parser
    rows = _command_rows()
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    missing = []
    for name, parser in sub.choices.items():
        row = rows.get(name, "")
        if not row:
            missing.append(f"hethub {name}: no row")
        for action in parser._actions:
            flags = [o for o in action.option_strings if o.startswith("--") and o != "--help"]
            if not flags:
                continue
            if not any(f"{o}" in row for o in action.option_strings):
                missing.append(f"hethub {name} {flags[0]}")
            elif action.default not in (None, False, argparse.SUPPRESS) and _shown(action.default) not in row:
                missing.append(f"hethub {name} {flags[0]}: default {_shown(action.default)}")
    missing += [f"hethub launch {f}" for f in OWN_FLAGS if f not in rows.get("launch", "")]
    from hethub.cli.elastic_launch import FLAGS as ELASTIC_FLAGS
    missing += [f"hethub launch --elastic {f}" for f in ELASTIC_FLAGS if f not in rows.get("launch", "")]
    assert not missing, missing


def _quickstart_lines() -> list[str]:
    text = open(os.path.join(ROOT, "README.md")).read()
    section = text[text.index("## Quickstart"):]
    section = section[:section.index("\n## ", 5)]
    return [line for block in re.findall(r"```sh\n(.*?)```", section, re.S) for line in block.strip().splitlines()]


@pytest.mark.slow
def test_the_quickstart_runs_as_written(tmp_path):
    """Every quickstart line runs in a fresh folder holding examples/ (one marked [several hosts] needs the
    cluster's hosts: it is only dry-run here, by the line before it)."""
    import shutil
    import subprocess
    import sys
    shutil.copytree(os.path.join(ROOT, "examples"), tmp_path / "examples")
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""),
               OMP_NUM_THREADS="1")
    lines = _quickstart_lines()
    assert len(lines) >= 6 and sum("# [several hosts]" in line for line in lines) == 1, lines
    for line in lines:
        if "# [several hosts]" in line:
            continue
        r = subprocess.run(["bash", "-c", line], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, (line, r.stdout[-2000:], r.stderr[-2000:])
        if line.startswith("hethub launch") and "--local" in line:
            assert re.search(r"^step +2 +loss [\d.]+", r.stdout + r.stderr, re.M), r.stdout[-2000:]
    for out in ("my-cluster.yaml", "plan.json", "plan.png", "tiny.json"):
        assert (tmp_path / out).is_file(), out
    # the --local run is a heterogeneous one: both types of the workstation, in the dtype the scripts train in
    tiny = Plan.model_validate_json((tmp_path / "tiny.json").read_text())
    assert set(tiny.devices_by_type()) == {"BIG", "SMALL"} and tiny.dtype == "fp32", tiny.devices_by_type()
