"""hethub launch: hostfile/include mapping, LOCAL_RANK, mismatch through DeepSpeed's launcher, the demo."""
import os
import re
import subprocess
import sys
import time

import pytest

from conftest import EXAMPLES, ROOT, SITE, run_cli
from hethub.partitioner import InputError, Plan
from plans import MODEL, UNEQUAL, unequal_plan

def test_hostfile_and_include_reproduce_the_plans_ranks():
    from hethub.cli.launch import host_layout, hostfile_text, include_arg
    plan = unequal_plan()
    layout = host_layout(plan)
    # DeepSpeed numbers ranks host by host (hostfile order), slots ascending (include list)
    ds_ranks = {}
    r = 0
    for host, slots in layout:
        for slot in slots:
            ds_ranks[(host, slot)] = r
            r += 1
    for st in plan.stages:
        for rep in st.replicas:
            assert ds_ranks[(rep.host, rep.slot)] == rep.rank
    hosts = [line.split()[0] for line in hostfile_text(plan).splitlines()]
    assert hosts == [h for h, _ in layout]
    assert include_arg(plan) == "@".join(f"{h}:{','.join(map(str, s))}" for h, s in layout)


def test_local_rank_follows_the_plan_not_deepspeeds_rotation():
    from hethub.runtime.checks import plan_local_index
    plan = unequal_plan()
    layout = dict((h, s) for h, s in __import__("hethub.cli.launch", fromlist=["x"]).host_layout(plan))
    rotated = 0
    for st in plan.stages:
        for rep in st.replicas:
            local = plan_local_index(plan, rep.rank)
            assert layout[rep.host][local] == rep.slot
            ds_local = rep.rank % len(layout[rep.host])  # deepspeed.launcher.launch's LOCAL_RANK
            rotated += ds_local != local
    assert rotated > 0  # the unequal node sizes do rotate DeepSpeed's mapping here


def test_plan_that_deepspeed_cannot_number_is_refused():
    from hethub.cli.launch import host_layout
    data = unequal_plan().model_dump()
    reps = [r for s in data["stages"] for r in s["replicas"]]
    a, b = reps[0], reps[-1]  # swap two ranks across hosts
    a["rank"], b["rank"] = b["rank"], a["rank"]
    with pytest.raises(InputError, match="plan.stages: rank"):
        host_layout(Plan.model_validate(data))


def test_launch_dry_run_passes_flags_through(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text(unequal_plan().to_json())
    script = os.path.join("examples", "train_gpt.py")  # the script must exist (run_cli runs in the repository)
    r = run_cli("launch", "--hetero-plan", str(path), "--dry-run", "--master_port", "29600", script, "--lr", "1")
    assert r.returncode == 0, r.stderr
    cmd = next(l for l in r.stdout.splitlines() if "deepspeed.launcher.runner" in l).split()
    assert cmd[cmd.index("--master_port") + 1] == "29600"
    from hethub.cli.launch import include_arg
    assert cmd[cmd.index("--include") + 1] == include_arg(unequal_plan()) == "small:0,1@big:0,1,2"
    i = cmd.index(script)  # each rank starts through hethub's entry, which takes the plan; the script's args as given
    assert cmd[i - 4:] == ["--module", "hethub.cli.rank_entry", "--hetero-plan", str(path), script, "--lr", "1"]
    r = run_cli("launch", "--hetero-plan", str(path), "--include", "big:0", script)
    assert r.returncode == 2 and r.stderr.startswith("error: --include: the plan places every rank")


MULTI_HOST_CASES = {  # plan on hosts small (node 0) and big (node 1); flags after --hetero-plan P
    "no_master_addr": (["--no_ssh"], "error: --master_addr: --no_ssh needs the address of node 0, host 'small'"),
    "node_rank_2": (["--no_ssh", "--master_addr", "10.0.0.1", "--node_rank", "2"],
                    "error: --node_rank: must be in 0..1 (node ranks: 0 = 'small', 1 = 'big'), got 2"),
    "unknown_host": (["--no_ssh", "--master_addr", "10.0.0.1"], "error: --node_rank: this machine ("),
    "no_pdsh": ([], "error: launch: the plan spans 2 hosts and DeepSpeed's pdsh launcher is not installed"),
    # hethub's own flags may come anywhere before the script: --dry-run is hethub's, the missing address is said
    "dry_run_after_deepspeeds": (["--no_ssh", "--dry-run"], "error: --master_addr: --no_ssh needs the address of "
                                                            "node 0, host 'small'"),
}


@pytest.mark.parametrize("name", sorted(MULTI_HOST_CASES))
def test_multi_host_launch_without_what_it_needs_is_one_line(tmp_path, name):
    """A launch on several hosts that could not start says which flag, before DeepSpeed's runner starts."""
    pytest.importorskip("deepspeed")
    flags, line = MULTI_HOST_CASES[name]
    path = tmp_path / "plan.json"
    path.write_text(unequal_plan().to_json())
    empty = tmp_path / "bin"  # no pdsh on PATH, whatever this machine has
    empty.mkdir()
    r = run_cli("launch", "--hetero-plan", str(path), *flags, "train.py", env={"PATH": str(empty)})
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [r.stderr.strip()], r.stderr[-1000:]
    assert r.stderr.startswith(line), r.stderr


def test_one_host_plan_on_another_machine_without_pdsh_is_one_line(tmp_path):
    """Before: the pdsh check was skipped for a plan of one host, and DeepSpeed's runner ended in a traceback
    ("host=node1 was not reachable via ssh"); the README's Hugging Face example met it."""
    pytest.importorskip("deepspeed")
    from hethub.partitioner.placement import StageLayout, build_plan
    elsewhere = UNEQUAL.model_copy(update={"nodes": UNEQUAL.nodes[:1]})  # host 'big' only: not this machine
    plan = build_plan(MODEL, elsewhere, [StageLayout((0, 4), "X", (2,))], 2, 1)
    path = tmp_path / "plan.json"
    path.write_text(plan.to_json())
    empty = tmp_path / "bin"
    empty.mkdir()
    r = run_cli("launch", "--hetero-plan", str(path), "train.py", env={"PATH": str(empty)})
    assert r.returncode == 2 and r.stderr.startswith("error: launch: the plan's one host 'big' is not this machine "
                                                     "(--local runs every rank here)"), r.stderr[-800:]


def test_no_ssh_launch_finds_its_node_rank_by_host_name_or_address(tmp_path, monkeypatch):
    from hethub.cli.launch import build_command
    monkeypatch.setattr("socket.gethostname", lambda: "big.cluster.example")
    cmd, _ = build_command("p.json", unequal_plan(), ["--no_ssh", "--master_addr", "10.0.0.1", "train.py"], False,
                           str(tmp_path / "hostfile"))
    assert cmd[cmd.index("--node_rank") + 1] == "1"  # big is the plan's second host
    assert (tmp_path / "hostfile").read_text() == "small slots=2\nbig slots=3\n"
    cmd, _ = build_command("p.json", unequal_plan(), ["--no_ssh", "--master_addr", "10.0.0.1", "--node_rank", "0",
                                                      "train.py"], False, str(tmp_path / "hostfile"))
    assert cmd.count("--node_rank") == 1 and cmd[cmd.index("--node_rank") + 1] == "0"
    # hosts given as addresses: the one this machine holds (loopback here; 192.0.2.1 is TEST-NET, never local)
    data = unequal_plan().model_dump()
    renamed = {"big": "127.0.0.1", "small": "192.0.2.1"}
    for node in data["cluster"]["nodes"]:
        node["host"] = renamed[node["host"]]
    for st in data["stages"]:
        for rep in st["replicas"]:
            rep["host"] = renamed[rep["host"]]
    cmd, _ = build_command("p.json", Plan.model_validate(data), ["--no_ssh", "--master_addr", "192.0.2.1",
                                                                 "train.py"], False, str(tmp_path / "hostfile"))
    assert cmd[cmd.index("--node_rank") + 1] == "1"


def test_launch_and_dry_runs_leave_no_temporary_folder(tmp_path, monkeypatch, capsys):
    pytest.importorskip("deepspeed")
    from hethub.cli.launch import run
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    path = tmp_path / "plan.json"
    path.write_text(unequal_plan().to_json())
    script = os.path.join(EXAMPLES, "train_gpt.py")
    with pytest.raises(InputError, match="--include"):
        run(str(path), ["--include", "big:0", script])
    assert run(str(path), [script], local=True, dry_run=True) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]
    assert run(str(path), [script], dry_run=True) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]  # the dry run used to keep its folder
    out = capsys.readouterr().out
    assert "--hostfile HOSTFILE --include" in out and out.endswith(":\nsmall slots=2\nbig slots=3\n")


@pytest.mark.dist
def test_world_mismatch_through_deepspeeds_launcher_exits_2_and_leaves_nothing(tmp_path):
    pytest.importorskip("deepspeed")
    plan = unequal_plan()  # 5 ranks
    path = tmp_path / "plan.json"
    path.write_text(plan.to_json())
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", PYTHONPATH=ROOT + os.pathsep + SITE)
    tag = f"hethub-mismatch-{os.getpid()}"
    from dist_util import run_deepspeed
    r = run_deepspeed("3", [os.path.join(EXAMPLES, "train_gpt.py"), "--hetero-plan", str(path), "--steps", "1",
                        "--log-json", tag], capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert r.returncode == 2
    errors = [l for l in r.stdout.splitlines() + r.stderr.splitlines() if l.startswith("error:")]
    assert len(errors) == 3 and len(set(errors)) == 1
    assert errors[0] == "error: plan: plan needs world size 5 (2 + 3 ranks), launched with 3"
    time.sleep(0.5)
    ps = subprocess.run(["ps", "-ww", "-eo", "args"], capture_output=True, text=True).stdout
    assert tag not in ps


@pytest.mark.dist
@pytest.mark.slow
def test_demo_runs_end_to_end(tmp_path):
    """`hethub demo` (short): plans, runs hethub's plan, the FAST-only plan and DeepSpeed's partition through
    DeepSpeed's launcher, and ends with the table and the speed-up lines."""
    pytest.importorskip("deepspeed")
    r = run_cli("demo", "--steps", "2", "--global-batch", "16", "-o", str(tmp_path), timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert re.search(r"hethub vs fastest-only: [\d.]+x measured \([\d.]+x predicted; step by step [\d.]+x-[\d.]+x\)",
                     r.stdout), r.stdout[-3000:]
    assert re.search(r"hethub vs DeepSpeed: [\d.]+x measured", r.stdout)
    assert "step 2/2 loss" in r.stdout  # progress, step by step
    for f in ("plan.json", "timeline.png", "timeline-fastest-only.png", "timeline-deepspeed.png", "train-log.json",
              "run-hethub.json", "run-fast.json", "run-deepspeed.json"):
        assert (tmp_path / f).exists(), f


def test_the_demo_pins_deepspeeds_layers_and_plans_alike_on_any_fast_enough_machine():
    """DeepSpeed's run is pinned to the baseline plan of its layout as hethub's is (it was not: its layers idled to
    k x their fastest time, which two busy processes stretched to twice the prediction); the emulated devices'
    times are fixed, doubled only where this CPU's compute would not stay under half of them."""
    from hethub.cli import demo
    from hethub.partitioner import ModelConfig
    from hethub.partitioner.records import Profile
    cmd = demo._launch_command(unequal_plan(), "ds.json", True, "worker.py", ["--out", "o.json"])
    assert cmd[cmd.index("--pin-plan") + 1] == "ds.json" and cmd[cmd.index("--mode") + 1] == "deepspeed"
    assert "--pin-plan" not in demo._launch_command(unequal_plan(), "p.json", False, "worker.py", [])
    model = ModelConfig.model_validate(demo.DEMO_MODEL)

    def measured(block_ms: float) -> Profile:  # forward+backward of a block, as measured under the emulation
        layers = [{"index": i, "kind": k, "forward_ms": ms / 3, "backward_ms": 2 * ms / 3}
                  for i, (k, ms) in enumerate([("embedding", 1.0)] + [("block", block_ms)] * model.num_layers
                                              + [("head", 4.0)])]
        return Profile.model_validate({"device_type": "FAST", "model": model.model_dump(), "micro_batch_size": 2,
                                       "dtype": "fp32", "emulated_slowdown": demo.FAST_SLOWDOWN, "layers": layers})
    pin = sum(demo._pin_ms("block", 2))  # 24 ms
    assert demo._pin_scale([measured(10.0)]) == 1.0  # 2.5 ms of compute here: far under the pin
    assert demo._pin_scale([measured(demo.FAST_SLOWDOWN * pin / demo.PIN_HEADROOM * 1.5)]) == 2.0
    pinned = demo._pinned(measured(10.0), 2.0)
    assert [l.forward_ms + l.backward_ms for l in pinned.layers][1] == 2 * pin


@pytest.mark.parametrize("dry", [[], ["--dry-run"]])
def test_a_missing_training_script_is_one_line_before_the_launcher_starts(dry):
    """Before: eight ranks each printed "can't open file" (35 lines, 16 s), and a dry run exited 0."""
    r = run_cli("launch", "--hetero-plan", os.path.join(EXAMPLES, "plan.json"), "--local", *dry, "nothere.py",
                timeout=60)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr[-2000:]
    assert lines[0].startswith("error: launch: no training script 'nothere.py'"), lines[0]


CONFIG_CASES = {  # ds_config given to the script -> the launcher's one line (was: each rank's, after start-up)
    "batch": ({"train_batch_size": 7}, "error: config.train_batch_size: must agree with the plan (8), got 7"),
    "micro": ({"train_micro_batch_size_per_gpu": 2},  # a replica's rows: DeepSpeed's key means the whole micro-batch
              "error: config.train_micro_batch_size_per_gpu: must agree with the plan (4: the plan's micro-batch, "
              "not one replica's share of it), got 2"),
    "zero3": ({"zero_optimization": {"stage": 3}}, "error: config.zero_optimization.stage: hethub runs ZeRO stage 0"),
    "zero_list": ({"zero_optimization": [1]}, "error: config.zero_optimization: expected an object"),
    "hetero_typo": ({"hetero": {"timout_s": 5}}, "error: config.hetero.timout_s: unknown field"),
    "two_dtypes": ({"bf16": {"enabled": True}, "fp16": {"enabled": True}}, "error: config.fp16.enabled: bf16 and fp16"),
}


@pytest.mark.parametrize("name", sorted(CONFIG_CASES))
def test_the_launcher_checks_the_scripts_ds_config_before_deepspeed_starts(tmp_path, capsys, name):
    import json
    from hethub.cli.main import main
    config, expected = CONFIG_CASES[name]
    plan, cfg = tmp_path / "plan.json", tmp_path / "ds.json"
    plan.write_text(unequal_plan().to_json())
    cfg.write_text(json.dumps(config))
    script = os.path.join(ROOT, "examples", "train_gpt.py")
    for flags in (["--dry-run", "--local"], ["--local"]):  # the real launch stops before DeepSpeed too
        for tail in (["--deepspeed_config", str(cfg)], [f"--deepspeed_config={cfg}"]):
            assert main(["launch", "--hetero-plan", str(plan), *flags, script, *tail]) == 2
            err = capsys.readouterr().err.strip()
            assert err.startswith(expected) and len(err.splitlines()) == 1, err


@pytest.mark.parametrize("own, ds, level", [([], [], "--log_level=warning"), (["--verbose"], [], None),
                                            ([], ["--log_level", "debug"], None), ([], ["-q"], None)])
def test_deepspeeds_launcher_logs_warnings_unless_asked(capsys, own, ds, level):
    """DeepSpeed's runner and launcher log at INFO by default: 34 of a local run's 39 lines."""
    from hethub.cli.main import main
    path = os.path.join(EXAMPLES, "plan.json")
    assert main(["launch", "--hetero-plan", path, "--dry-run", "--local", *own, *ds,
                 os.path.join(ROOT, "examples", "train_gpt.py")]) == 0
    cmd = next(l for l in capsys.readouterr().out.splitlines() if "deepspeed.launcher.runner" in l).split()
    assert ("--log_level=warning" in cmd) == (level is not None), cmd
    assert cmd.count("--log_level") + sum(c.startswith("--log_level=") for c in cmd) <= 1


def test_the_demo_tells_deepspeed_it_runs_on_cpu_before_deepspeed_is_imported(monkeypatch):
    """Its first line was DeepSpeed's "Setting accelerator to CPU ... unable to detect it" warning."""
    import importlib
    import types
    cli_main = importlib.import_module("hethub.cli.main")  # the module (hethub.cli's `main` is its function)
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    seen = {}
    real = cli_main.importlib.import_module

    def fake(name, package=None):
        if name == ".demo":
            seen["DS_ACCELERATOR"] = os.environ.get("DS_ACCELERATOR")
            return types.SimpleNamespace(cmd_demo=lambda args: 0)
        return real(name, package)

    monkeypatch.setattr(cli_main.importlib, "import_module", fake)
    assert cli_main.main(["demo"]) == 0
    assert seen == {"DS_ACCELERATOR": "cpu"}


def test_a_dry_run_needs_no_deepspeed_and_a_launch_without_it_is_one_line():
    """A planning laptop has no DeepSpeed: ``launch --dry-run`` prints the command and the hostfile all the same
    (launcher flags written --name=value; one that takes its value apart needs DeepSpeed's parser), and a real
    launch there is one line naming what to install, before anything starts."""
    block = "import sys; sys.modules['deepspeed'] = None; sys.modules['torch'] = None; from hethub.cli.main import main; "
    plan = os.path.join(EXAMPLES, "plan.json")
    script = os.path.join(EXAMPLES, "train_gpt.py")

    def launch(*args):
        return subprocess.run([sys.executable, "-c", block + f"sys.exit(main({['launch', '--hetero-plan', plan, *args]!r}))"],
                              capture_output=True, text=True, timeout=60, cwd=ROOT)
    r = launch("--dry-run", "--master_port=29600", script, "--steps", "2")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "-m deepspeed.launcher.runner --log_level=warning --master_port=29600 --hostfile HOSTFILE" in r.stdout
    assert r.stdout.rstrip().endswith("node1 slots=8\nnode2 slots=4"), r.stdout
    for args in (("--dry-run", "--master_port", "29600", script), (script,)):
        r = launch(*args)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and "needs deepspeed, which this install lacks" in lines[0], \
            r.stderr[-2000:]


def test_a_launch_with_only_hethubs_own_launcher_flags_does_not_import_deepspeed_to_parse_them():
    """DeepSpeed's runner parses the command again in its own process: parsing it here too cost every launch ~2 s
    of CPU importing DeepSpeed. A flag of the user's (`--master_port 29600`) still goes through DeepSpeed's parser."""
    plan, script = os.path.join(EXAMPLES, "plan.json"), os.path.join(EXAMPLES, "train_gpt.py")
    for flags, imported in (([], False), (["--master_port", "29600"], True)):
        code = ("import sys; from hethub.cli.main import main; "
                f"rc = main({['launch', '--hetero-plan', plan, '--local', '--dry-run', *flags, script]!r}); "
                "print('deepspeed imported:', 'deepspeed' in sys.modules); sys.exit(rc)")
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT,
                           env=dict(os.environ, DS_ACCELERATOR="cpu"))
        assert r.returncode == 0, r.stderr[-2000:]
        assert f"deepspeed imported: {imported}" in r.stdout and "-m deepspeed.launcher.runner" in r.stdout, r.stdout
