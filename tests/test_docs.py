"""The docs a newcomer reads: every relative link in the README, docs/ and the benchmark tables resolves, and the
summary lines print numbers as people read them."""
import os
import re

import pytest

from conftest import ROOT, SITE, run_cli
from hethub.partitioner.outputs import num

PAGES = (["README.md"] + [os.path.join("docs", f) for f in sorted(os.listdir(os.path.join(ROOT, "docs")))]
         + [os.path.join("benchmarks", "results", f)
            for f in sorted(os.listdir(os.path.join(ROOT, "benchmarks", "results")))])


@pytest.mark.parametrize("page", [p for p in PAGES if p.endswith(".md")])
def test_every_relative_link_resolves(page):
    with open(os.path.join(ROOT, page)) as f:
        text = f.read()
    broken = []
    for m in re.finditer(r"\]\(([^)\s]+)\)", text):
        link = m.group(1).split("#")[0]
        if not link or link.startswith(("http://", "https://", "mailto:")):
            continue
        if not os.path.exists(os.path.normpath(os.path.join(ROOT, os.path.dirname(page), link))):
            broken.append(m.group(1))
    assert not broken, f"{page}: {broken}"


# What a docs command that cannot run from a fresh clone on this machine says it needs (in its trailing comment)
NEEDS = ("[several hosts]", "[on a GPU]", "[your files]")
DOCS = [os.path.join("docs", f) for f in sorted(os.listdir(os.path.join(ROOT, "docs"))) if f.endswith(".md")]


def _commands(page: str) -> list[list[str]]:
    """The command lines of each ```sh block of a page, continuation lines joined."""
    with open(os.path.join(ROOT, page)) as f:
        blocks = re.findall(r"```(?:sh|bash)\n(.*?)```", f.read(), re.S)
    return [[line.strip() for line in re.sub(r"\\\n\s*", " ", block).splitlines()
             if line.strip() and not line.strip().startswith("#")] for block in blocks]


@pytest.mark.parametrize("page", DOCS)
def test_every_docs_command_runs_as_written_or_says_what_it_needs(page, tmp_path):
    """Each command of a docs page's shell blocks runs, in order, from a folder holding the repository's
    examples (a fresh clone), and exits 0 -- or its comment says why it cannot here: several hosts, a GPU, or
    files of the reader's own. (docs/models.md's Megatron recipe failed on every example cluster: its plan
    served a device type in two runs of stages, which torchrun cannot launch.)"""
    import shlex
    import subprocess
    import sys
    for name in ("examples", "README.md"):
        os.symlink(os.path.join(ROOT, name), tmp_path / name)
    for block in _commands(page):
        for line in block:
            command, _, comment = line.partition("#")
            if any(need in comment for need in NEEDS):
                continue
            argv = shlex.split(command)
            assert argv[0] == "hethub", f"{page}: {line}"
            r = subprocess.run([sys.executable, "-m", "hethub.cli", *argv[1:]], cwd=tmp_path, capture_output=True,
                               text=True, timeout=300, env=dict(os.environ, PYTHONPATH=ROOT + os.pathsep + SITE))
            assert r.returncode == 0, f"{page}: {line}\n{r.stdout[-1500:]}{r.stderr[-1500:]}"


def test_numbers_print_without_exponents():
    assert [num(x) for x in (16520.376, 1.909, 123.45, 0.0, 0.00042)] == ["16,520", "1.909", "123.5", "0", "4.20e-04"]


def test_a_cluster_without_a_network_section_is_said(tmp_path):
    cluster = tmp_path / "c.yaml"
    cluster.write_text("nodes:\n  - {host: a, device_type: A100-80GB, count: 2}\n")
    r = run_cli("plan", "--cluster", str(cluster), "--model", "gpt-125m", "--global-batch", "8", "--time-limit", "2",
                "--no-compare", "-o", str(tmp_path / "p.json"))
    assert r.returncode == 0, r.stderr
    assert "has no network section: assuming 2,400 Gbit/s between devices of a node" in " ".join(r.stdout.split())


def test_simulate_png_without_matplotlib_says_so_before_replaying(tmp_path, monkeypatch, capsys):
    import sys
    from hethub.cli import simulate as simulate_cli
    from hethub.cli.main import main
    plan = os.path.join(ROOT, "examples", "plan.json")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as where it is not installed
    monkeypatch.setattr(simulate_cli, "simulate", lambda *a, **k: pytest.fail("replayed before saying"))
    assert main(["simulate", plan, "--png", str(tmp_path / "t.png")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --png: ") and "matplotlib" in err and not (tmp_path / "t.png").exists()


def test_show_names_every_host_bridge_between_vendors():
    from hethub.cli.show import bridge_lines
    from hethub.partitioner import Cluster, builtin_model
    from hethub.partitioner.placement import StageLayout, build_plan
    cluster = Cluster.model_validate({"nodes": [{"host": "nv", "device_type": "A100-80GB", "count": 2},
                                                {"host": "amd", "device_type": "MI300X", "count": 2}]})
    model = builtin_model("gpt-125m")
    plan = build_plan(model, cluster, [StageLayout((0, 7), "A100-80GB", (4,)), StageLayout((7, 10), "A100-80GB", (4,)),
                                       StageLayout((10, 14), "MI300X", (2, 2))], 4, 4)
    assert bridge_lines(plan) == ["host bridge after chunk 1 (group 1 nvidia -> group 2 amd): device -> host -> "
                                  "device over gloo"]


@pytest.mark.parametrize("profiles", ["nope", "README.md"])
def test_simulate_with_a_profiles_folder_that_is_not_one_is_one_line(profiles):
    r = run_cli("simulate", os.path.join("examples", "plan.json"), "--profiles", profiles)
    assert r.returncode == 2 and r.stderr == f"error: --profiles: no such directory {profiles!r}\n", r.stderr


def test_a_dtype_set_by_types_the_plan_leaves_idle_is_said(tmp_path):
    """examples/cluster.yaml has V100s (no bf16), so the plan trains fp16; a small model's plan leaves them all
    idle, and the A100s it uses compute bf16."""
    r = run_cli("plan", "--cluster", os.path.join("examples", "cluster.yaml"), "--model", "gpt-125m",
                "--global-batch", "4", "--time-limit", "3", "--no-compare", "-o", str(tmp_path / "p.json"))
    assert r.returncode == 0, r.stderr
    out = " ".join(r.stdout.split())
    assert "V100-32GB 0/4" in out and "the plan leaves every V100-32GB idle; the types it uses compute bf16" in out
