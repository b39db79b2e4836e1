"""A model hethub has never seen, from a user's DeepSpeed script: ``hethub profile --script`` measures its layers
(a convolutional front, in-place ReLUs, a tied pair), ``hethub plan`` plans it from the measurements alone
(``architecture: measured``), and the unchanged script trains under the plan like one process."""
import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, run_cli
from dist_util import one_process
from hethub.partitioner import Cluster, InputError, ModelConfig
from hethub.partitioner.costmodel import CostModel

SCRIPT = os.path.join(ROOT, "tests", "workers", "ds_pipeline_script.py")
LAYER = {"name": "0", "kind": "Linear", "params": 10, "trainable_params": 10, "activation_bytes": 64.0,
         "input_bytes": 16.0, "output_bytes": 32.0}
CPU = {"vendor": "cpu", "peak_tflops": {"fp32": 1}, "memory_gib": 16, "memory_gbps": 20}
CLUSTER = {"name": "two-cpu-types", "device_types": {"CPU-FAST": CPU, "CPU-SLOW": CPU},
           "nodes": [{"host": "localhost", "device_type": "CPU-FAST", "count": 1},
                     {"host": "localhost", "device_type": "CPU-SLOW", "count": 2}],
           "network": {"intra_node_gbps": 1, "inter_node_gbps": 1}}
DS_CONFIG = {"train_batch_size": 24, "train_micro_batch_size_per_gpu": 6,
             "optimizer": {"type": "SGD", "params": {"lr": 0.05}}}


def test_a_measured_model_is_its_layers_and_nothing_else():
    m = ModelConfig.model_validate({"architecture": "measured", "name": "m", "measured_layers": [LAYER] * 3})
    assert m.num_planner_layers == 3 and [li.kind for li in m.layers()] == ["layer"] * 3
    with pytest.raises(ValueError, match="hidden_size: a measured model has no transformer shape"):
        ModelConfig.model_validate({"architecture": "measured", "hidden_size": 64, "measured_layers": [LAYER]})
    with pytest.raises(ValueError, match="measured_layers: given exactly when architecture is 'measured'"):
        ModelConfig.model_validate({"architecture": "measured"})
    with pytest.raises(ValueError, match="measured_layers: given exactly when"):
        ModelConfig.model_validate({"architecture": "gpt", "num_layers": 2, "hidden_size": 8, "num_attention_heads": 1,
                                    "ffn_hidden_size": 8, "vocab_size": 8, "seq_length": 4, "measured_layers": [LAYER]})


def test_a_measured_model_is_priced_from_profiles_only():
    m = ModelConfig.model_validate({"architecture": "measured", "name": "m", "measured_layers": [LAYER] * 3})
    with pytest.raises(InputError, match="--profiles: no profile of model 'm' on device type 'CPU-FAST'"):
        CostModel(Cluster.model_validate(CLUSTER), m, dtype="fp32")


def _profile(tmp_path, device_type, slowdown, arch):
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps(DS_CONFIG))
    return run_cli("profile", "--script", SCRIPT, "--device-type", device_type, "--emulate-slowdown", str(slowdown),
                   "--micro-batch-size", "6", "--reps", "3", "-o", str(tmp_path / "prof"), "--", "--out",
                   str(tmp_path / "unused"), "--deepspeed_config", str(cfg), "--arch", arch,
                   env={"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}, timeout=180)


KINDS = {"conv": ["Conv2d", "ReLU", "Conv2d", "ReLU", "Flatten", "Linear", "Tanh", "Linear", "ReLU", "Linear", "Linear"],
         "mixed": ["Embedding", "TokenMixer", "GatedMLP", "TokenMixer", "GatedMLP", "LayerNorm", "MeanPool", "Linear"]}


@pytest.mark.dist
@pytest.mark.parametrize("arch", ["conv", "mixed"])
def test_an_unchanged_script_profiled_planned_and_run_trains_like_one_process(tmp_path, arch):
    """conv: convolutions, in-place ReLUs and a tied pair (DeepSpeed's tutorial shape); mixed: non-transformer
    blocks of several kinds (an embedding, MLP-Mixer token mixing, gated channel MLPs, pooling)."""
    pytest.importorskip("deepspeed")
    for device_type, slowdown in (("CPU-FAST", 1), ("CPU-SLOW", 2)):
        r = _profile(tmp_path, device_type, slowdown, arch)
        assert r.returncode == 0, r.stderr[-3000:]
        assert f"{device_type}.json (micro-batch 6, fp32)" in r.stdout
    model = json.loads((tmp_path / "prof" / "model.json").read_text())
    assert model["architecture"] == "measured" and [ml["kind"] for ml in model["measured_layers"]] == KINDS[arch]
    params = [ml["params"] for ml in model["measured_layers"]]
    assert params[:2] == ([2 * 4 * 9 + 4, 0] if arch == "conv" else [20 * 16, 2 * 16 + 8 * 8 + 8])
    cluster = tmp_path / "cluster.json"
    cluster.write_text(json.dumps(CLUSTER))
    plan = tmp_path / "plan.json"
    r = run_cli("plan", "--cluster", str(cluster), "--model", str(tmp_path / "prof" / "model.json"), "--profiles",
                str(tmp_path / "prof"), "--global-batch", "24", "--micro-batch-sizes", "6", "--time-limit", "10",
                "-o", str(plan))
    assert r.returncode == 0 and "priced with: profiles" in r.stdout, r.stderr[-2000:]
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", HETHUB_EMULATE_SLOWDOWN="CPU-SLOW=2",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    common = ["--steps", "2", "--deepspeed_config", str(tmp_path / "ds.json"), "--arch", arch]
    ref = one_process([SCRIPT, "--out", str(tmp_path / "ref"), "--stages", "1", *common],
                      extra_env={"HETHUB_EMULATE_SLOWDOWN": env["HETHUB_EMULATE_SLOWDOWN"]})
    assert ref.returncode == 0, ref.stderr[-3000:]
    run = subprocess.run([sys.executable, "-m", "hethub.cli", "launch", "--hetero-plan", str(plan), "--local", SCRIPT,
                          "--out", str(tmp_path / "run"), *common], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    want = torch.load(str(tmp_path / "ref.0"), weights_only=True)["losses"]
    world = json.loads(plan.read_text())
    ranks = sum(len(st["replicas"]) for st in world["stages"])
    for r in range(ranks):
        got = torch.load(str(tmp_path / f"run.{r}"), weights_only=True)
        assert got["engine"] == "HeteroPipelineEngine"
        torch.testing.assert_close(got["losses"], want, rtol=2e-5, atol=0)


def test_profile_script_errors_are_one_line(tmp_path):
    r = run_cli("profile", "--script", str(tmp_path / "nothere.py"), "--device-type", "X", "-o", str(tmp_path / "p"))
    assert r.returncode == 2 and r.stderr.strip() == f"error: --script: no such file {str(tmp_path / 'nothere.py')!r}"
    script = tmp_path / "no_step.py"
    script.write_text("print('hello')\n")
    r = run_cli("profile", "--script", str(script), "--device-type", "X", "-o", str(tmp_path / "p"))
    assert r.returncode == 2 and "ended without a train_batch" in r.stderr.strip().splitlines()[-1]
    r = run_cli("profile", "--script", str(script), "--device-type", "../evil", "-o", str(tmp_path / "p"))
    assert r.returncode == 2 and r.stderr.startswith("error: --device-type: with --script it names the profile file")


def test_a_measured_model_plans_on_a_two_type_cluster_and_megatron_export_refuses_it(tmp_path):
    from hethub.partitioner.api import make_plan
    from hethub.partitioner.megatron_export import export_megatron
    from hethub.partitioner.planner import PlannerOptions
    from hethub.partitioner.records import LayerProfile, Profile
    layers = [{**LAYER, "name": str(i), "params": 1000 * (i + 1)} for i in range(6)]
    m = ModelConfig.model_validate({"architecture": "measured", "name": "m", "measured_layers": layers})
    profiles = [Profile(device_type=t, model=m, micro_batch_size=4, layers=[
        LayerProfile(index=i, kind="layer", forward_ms=k * (i + 1), backward_ms=2 * k * (i + 1)) for i in range(6)])
        for t, k in (("CPU-FAST", 1.0), ("CPU-SLOW", 2.0))]
    plan = make_plan(Cluster.model_validate(CLUSTER), m, 16, profiles=profiles, cost_model=None,
                     opts=PlannerOptions(time_limit_s=5), with_homogeneous_sum=False)
    assert plan.model.measured and plan.predicted.samples_per_s > 0
    assert {t for st in plan.stages for t in st.types} == {"CPU-FAST", "CPU-SLOW"}  # the slow type pulls weight
    with pytest.raises(InputError, match="plan.model: 'm' is a measured model"):
        export_megatron(plan)
