"""Tier 1 (pure): records, their JSON/YAML round trips, validation errors, the catalogue."""
import os
import subprocess
import sys

import pytest
import yaml

from conftest import DATA, EXAMPLES, ROOT, run_cli
from hethub.partitioner import (Cluster, InputError, Profile, builtin_device_type, builtin_model, load_cluster,
                                load_model, load_plan, load_profile)
from hethub.partitioner.records import LayerProfile

BAD = os.path.join(DATA, "bad")
EXPECTED = yaml.safe_load(open(os.path.join(BAD, "expected.yaml")))


def test_catalogue_has_required_types_and_models():
    for name in ["A100-40GB", "A100-80GB", "H100-80GB", "H200", "V100-16GB", "V100-32GB", "T4", "L4", "A10",
                 "RTX-3090", "RTX-4090", "MI250X", "MI300X"]:
        dt = builtin_device_type(name)
        assert dt.peak("bf16") > 0 and dt.memory_gib > 0 and dt.memory_gbps > 0
    for name in ["gpt-125m", "gpt-1.3b", "gpt-6.7b", "llama-7b", "llama-13b", "llama-70b", "llama-140b"]:
        m = builtin_model(name)
        assert len(m.layers()) == m.num_layers + 2
    # V100 has no bf16: bf16 runs without tensor cores (its fp32 peak); fp16 has them.
    v100 = builtin_device_type("V100-32GB")
    assert (v100.peak("bf16"), v100.peak("fp16"), v100.native("bf16")) == (15.7, 125.0, False)


def test_layer_list_order():
    layers = builtin_model("gpt-125m").layers()
    assert [l.kind for l in layers] == ["embedding"] + ["block"] * 12 + ["head"]
    assert [l.index for l in layers] == list(range(14))


@pytest.mark.parametrize("record", [
    builtin_device_type("MI300X"),
    builtin_model("llama-70b"),
    load_cluster(os.path.join(EXAMPLES, "cluster.yaml")),
    load_plan(os.path.join(EXAMPLES, "plan.json")),
    Profile(device_type="A100-80GB", model=builtin_model("gpt-tiny"), micro_batch_size=2,
            layers=[LayerProfile(index=0, kind="embedding", forward_ms=1.0, backward_ms=2.0, peak_memory_bytes=10)]),
])
def test_json_round_trip(record):
    again = type(record).from_json(record.to_json())
    assert again == record
    assert again.to_json() == record.to_json()


def test_yaml_input_equals_json_input(tmp_path):
    c = load_cluster(os.path.join(EXAMPLES, "cluster.yaml"))
    p = tmp_path / "c.json"
    p.write_text(c.to_json())
    assert load_cluster(str(p)) == c
    assert c.device_type("MY-GPU").peak("bf16") == 100
    assert c.count_by_type() == {"A100-80GB": 8, "V100-32GB": 4}


def test_partial_override_of_builtin_type_keeps_the_rest():
    c = Cluster.model_validate({"device_types": {"A100-80GB": {"efficiency": 0.3}},
                                "nodes": [{"host": "a", "device_type": "A100-80GB", "count": 1}]})
    dt = c.device_type("A100-80GB")
    assert dt.efficiency == 0.3 and dt.memory_gib == 80 and dt.vendor == "nvidia"


def test_model_by_name_or_file():
    assert load_model("llama-7b").hidden_size == 4096
    m = load_model(os.path.join(EXAMPLES, "model.yaml"))
    assert m.name == "gpt-small" and m.num_planner_layers == 26
    with pytest.raises(InputError, match="no file and no built-in model named 'gpt-9'"):
        load_model("gpt-9")


def test_plan_helpers():
    plan = load_plan(os.path.join(EXAMPLES, "plan.json"))
    assert plan.world_size == 9
    assert plan.locate(4) == (1, 2)
    assert plan.stages[1].sample_ranges() == [(0, 3), (3, 6), (6, 8)]
    assert len(plan.idle_devices()) == 3


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_bad_corpus(name):
    path = os.path.join(BAD, name)
    kind = name.split("_")[0]
    loader = {"plan": load_plan, "cluster": load_cluster, "model": load_model, "profile": load_profile}[kind]
    with pytest.raises(InputError) as exc:
        loader(path)
    msg = str(exc.value)
    assert EXPECTED[name] in msg, msg
    assert "\n" not in msg


def test_every_bad_file_is_listed():
    files = {f for f in os.listdir(BAD) if f != "expected.yaml"}
    assert files == set(EXPECTED)


def test_cli_bad_plan_one_line_exit_2():
    r = run_cli("show", os.path.join(BAD, "plan_samples_sum.json"))
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0
    assert r.stderr.startswith("error: plan.stages[1].replicas: samples must sum")
    assert "Traceback" not in r.stderr


def test_cli_show_and_help(example_plan_path):
    r = run_cli("show", example_plan_path)
    assert r.returncode == 0, r.stderr
    assert "lab-mixed" in r.stdout and "3+3+2" in r.stdout
    r = run_cli("--help")
    assert r.returncode == 0 and "plan" in r.stdout and "simulate" in r.stdout


def test_cli_bad_flag_one_line():
    r = run_cli("show")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "plan" in r.stderr


def test_planning_package_does_not_import_torch():
    code = ("import sys, hethub.partitioner, hethub.cli, hethub.cli.show\n"
            "bad = [m for m in ('torch', 'deepspeed', 'triton') if m in sys.modules]\n"
            "print(','.join(bad))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ""


def test_a_yaml_exponent_without_a_dot_is_a_peak_like_any_other_number():
    """YAML 1.1 reads ``1e3`` as a string; every float field takes it, so the peak does too."""
    import yaml
    from hethub.partitioner.records import DeviceType
    d = DeviceType.model_validate(yaml.safe_load("{vendor: nvidia, peak_tflops: 1e3, memory_gib: 8, memory_gbps: 1e3}"))
    assert d.peak_tflops == {"bf16": 1000.0, "fp16": 1000.0} and d.memory_gbps == 1000.0
