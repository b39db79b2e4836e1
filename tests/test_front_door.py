"""Tier 2: a DeepSpeed pipeline script that never mentions hethub runs under a plan, unchanged.

``tests/workers/ds_pipeline_script.py`` is the tutorial's shape (LayerSpecs with a convolutional front and
in-place ReLUs, a TiedLayerSpec pair, ``PipelineModule(num_stages=2)``, ``deepspeed.init_distributed``,
``deepspeed.initialize(args=..., model=..., model_parameters=..., training_data=...)``, ``train_batch()`` with no
iterator, ds_config batch keys and optimizer, ``save_checkpoint``). Launched by ``hethub launch --hetero-plan``
under a plan of unequal widths (2 / 1 / 3, uneven split) it trains like the same script run by DeepSpeed on one
process: the same losses, the same per-layer checkpoint. Routes that would run plain DeepSpeed under a plan end
in one line instead.
"""
import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import ROOT
from dist_util import one_process, run_deepspeed
from hethub.partitioner import ModelConfig
from hethub.partitioner.placement import StageLayout, build_plan
from instances import CPU_CLUSTER

pytestmark = pytest.mark.dist
pytest.importorskip("deepspeed")

SCRIPT = os.path.join(ROOT, "tests", "workers", "ds_pipeline_script.py")
MODEL = ModelConfig(name="ds-script", architecture="gpt", num_layers=9, hidden_size=8, num_attention_heads=1,
                    ffn_hidden_size=8, vocab_size=8, seq_length=1)  # 11 planner layers: the script's 11 specs
CONFIG = {"train_batch_size": 24, "train_micro_batch_size_per_gpu": 6, "gradient_clipping": 0.5,
          "optimizer": {"type": "Adam", "params": {"lr": 0.01, "torch_adam": True}}}


def _plan():
    return build_plan(MODEL, CPU_CLUSTER, [StageLayout((0, 4), "CPU", (4, 2)), StageLayout((4, 8), "CPU", (6,)),
                                          StageLayout((8, 11), "CPU", (2, 2, 2))], 6, 4)


def _env():
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _layer_files(folder):
    out = {}
    for name in sorted(os.listdir(folder)):
        if name.startswith("layer_") and name.endswith("-model_states.pt"):
            out[name] = torch.load(os.path.join(folder, name), weights_only=True)
    return out


def test_a_deepspeed_pipeline_script_runs_unchanged_under_a_plan_and_trains_like_one_process(tmp_path):
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps(CONFIG))
    plan = tmp_path / "plan.json"
    plan.write_text(_plan().to_json())
    common = ["--steps", "3", "--deepspeed_config", str(cfg)]
    ref = one_process([SCRIPT, "--out", str(tmp_path / "ref"), "--stages", "1", "--save", str(tmp_path / "ref-ckpt"),
                       *common])
    assert ref.returncode == 0, ref.stderr[-3000:]
    run = subprocess.run([sys.executable, "-m", "hethub.cli", "launch", "--hetero-plan", str(plan), "--local", SCRIPT,
                          "--out", str(tmp_path / "run"), "--stages", "2", "--save", str(tmp_path / "ckpt"), *common],
                         cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "PipelineModule(num_stages=2, partition_method='parameters') runs under the plan's stages" in run.stderr
    want = torch.load(str(tmp_path / "ref.0"), weights_only=True)
    assert want["engine"] == "PipelineEngine"
    for rank in range(6):
        got = torch.load(str(tmp_path / f"run.{rank}"), weights_only=True)
        assert got["engine"] == "HeteroPipelineEngine" and got["micro_batch"] == 6
        torch.testing.assert_close(got["losses"], want["losses"], rtol=2e-5, atol=0)
    ours, theirs = _layer_files(tmp_path / "ckpt" / "end"), _layer_files(tmp_path / "ref-ckpt" / "end")
    assert set(ours) == set(theirs) and len(ours) == 11
    for name, state in ours.items():
        # a tied weight: DeepSpeed writes it with every layer using it, hethub with the first (layer 5) only
        assert set(state) == (set() if name == "layer_09-model_states.pt" else set(theirs[name])), name
        for k, v in state.items():
            torch.testing.assert_close(v, theirs[name][k], rtol=0, atol=2e-5, msg=f"{name} {k}")


def _two_rank_plan(tmp_path):
    plan = build_plan(MODEL, CPU_CLUSTER, [StageLayout((0, 6), "CPU", (6,)), StageLayout((6, 11), "CPU", (6,))], 6, 4)
    path = tmp_path / "plan2.json"
    path.write_text(plan.to_json())
    return path


def _plain_deepspeed(tmp_path, config: dict, ranks: int = 2, extra=()):
    """The tutorial script run by plain `deepspeed` with `import hethub` added (its one changed line)."""
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps(config))
    script = tmp_path / "with_import.py"
    script.write_text(f"import sys\nsys.path.insert(0, {os.path.dirname(SCRIPT)!r})\nimport hethub  # noqa: F401\n"
                      "import ds_pipeline_script\nds_pipeline_script.main()\n")
    return run_deepspeed(ranks, [str(script), "--out", str(tmp_path / "run"), "--stages", str(ranks), "--steps", "1",
                                 "--deepspeed_config", str(cfg), *extra], cwd=ROOT, env=_env(), capture_output=True,
                         text=True, timeout=300)


def test_plain_deepspeed_with_a_hetero_section_and_import_hethub_builds_hethubs_engine(tmp_path):
    r = _plain_deepspeed(tmp_path, {**CONFIG, "hetero": {"plan": str(_two_rank_plan(tmp_path))}})
    assert r.returncode == 0, r.stderr[-3000:]
    for rank in range(2):
        assert torch.load(str(tmp_path / f"run.{rank}"), weights_only=True)["engine"] == "HeteroPipelineEngine"


@pytest.mark.parametrize("config, extra, line", [
    ({"hetero": {"plann": "p.json"}}, (), "error: config.hetero.plann: unknown field"),
    ({"heterro": {"plan": "p.json"}}, (), 'error: config.heterro: not a DeepSpeed key; did you mean "hetero"'),
    # plain deepspeed built the PipelineModule's layers itself: an optimizer over them would train nothing
    ({"hetero": {"plan": "PLAN"}, "optimizer": None}, ("--client-sgd",),
     "error: optimizer: built over parameters other than this rank's stage's"),
])
def test_a_hetero_section_that_would_not_end_in_hethubs_engine_is_one_line(tmp_path, config, extra, line):
    config = {**CONFIG, **config}
    if config["optimizer"] is None:
        config.pop("optimizer")
    ranks = 1  # each rank says it at initialize, before any collective: one rank shows it
    if config.get("hetero", {}).get("plan") == "PLAN":
        config["hetero"]["plan"], ranks = str(_two_rank_plan(tmp_path)), 2
    r = _plain_deepspeed(tmp_path, config, ranks=ranks, extra=extra)
    assert r.returncode != 0
    said = [l for l in r.stdout.splitlines() + r.stderr.splitlines() if l.startswith("error: ")]
    assert said and all(l.startswith(line) for l in said), r.stdout[-2000:] + r.stderr[-2000:]


@pytest.mark.parametrize("body, line", [
    ("import deepspeed, torch\nfrom deepspeed.runtime.engine import DeepSpeedEngine\n"
     "deepspeed.init_distributed(dist_backend='gloo')\n"
     "DeepSpeedEngine(args=None, model=torch.nn.Linear(2, 2), config={'train_batch_size': 24})\n",
     "error: --hetero-plan: the script built DeepSpeed's own DeepSpeedEngine while a hethub plan is in force"),
    ("print('no engine')\n", "error: --hetero-plan: the script ended without building a DeepSpeed engine"),
])
def test_a_launched_script_that_does_not_build_hethubs_engine_ends_in_one_line(tmp_path, body, line):
    script = tmp_path / "no_hethub_engine.py"
    script.write_text(body)
    r = subprocess.run([sys.executable, "-m", "hethub.cli", "launch", "--local", "--hetero-plan",  # any order
                        str(_two_rank_plan(tmp_path)), str(script)],
                       cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode != 0
    said = [l for l in r.stdout.splitlines() + r.stderr.splitlines() if l.startswith("error: ")]
    # each rank says it, but DeepSpeed's per-node launcher kills the others once one exits non-zero: a rank
    # killed before its own line prints none (1 of ~15 suite runs)
    assert 1 <= len(said) <= 2 and all(l.startswith(line) for l in said), r.stdout[-2000:] + r.stderr[-2000:]


def test_an_optimizer_the_script_builds_over_the_pipeline_module_trains_the_plans_layers(tmp_path):
    """`torch.optim.SGD(net.parameters())` built by the script before initialize: under a plan the module's
    parameters are this rank's layers, the very tensors hethub trains (SGD: a wrong scale would show)."""
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({k: v for k, v in CONFIG.items() if k != "optimizer"}))
    common = ["--steps", "3", "--client-sgd", "--deepspeed_config", str(cfg)]
    ref = one_process([SCRIPT, "--out", str(tmp_path / "ref"), "--stages", "1", *common])
    assert ref.returncode == 0, ref.stderr[-3000:]
    run = subprocess.run([sys.executable, "-m", "hethub.cli", "launch", "--hetero-plan", str(_two_rank_plan(tmp_path)),
                          "--local", SCRIPT, "--out", str(tmp_path / "run"), "--stages", "2", *common],
                         cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    want = torch.load(str(tmp_path / "ref.0"), weights_only=True)["losses"]
    for rank in range(2):
        got = torch.load(str(tmp_path / f"run.{rank}"), weights_only=True)["losses"]
        torch.testing.assert_close(got, want, rtol=2e-5, atol=0)
        assert got[0] != got[-1]
