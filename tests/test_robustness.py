"""Tier 1: every bad input gets one clean line and exit 2 — never a traceback, never unbounded work.

A corpus of the input classes that once escaped (each case names the fragment its line must hold), a
property test that feeds random structures and mutations of valid files to every loader, and the
output rules (atomic, never over an input)."""
import json
import os
import subprocess
import sys
import threading
import time

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cli_util import cli_error, write
from conftest import EXAMPLES, ROOT, SITE
from hethub.cli.main import main
from hethub.partitioner import InputError, load_cluster, load_model, load_plan, load_profile
from hethub.partitioner.outputs import write_atomic

CLUSTER = os.path.join(EXAMPLES, "cluster.yaml")
PLAN = os.path.join(EXAMPLES, "plan.json")
PLAN_ARGS = ["plan", "--cluster", CLUSTER, "--model", "gpt-1.3b", "--global-batch", "8", "--no-compare",
             "--time-limit", "5"]


def cluster_with(**over) -> str:
    data = yaml.safe_load(open(CLUSTER))
    for key, value in over.items():
        node = data
        *parents, last = key.split(".")
        for p in parents:
            node = node[int(p)] if p.isdigit() else node[p]
        node[int(last) if last.isdigit() else last] = value
    return json.dumps(data)


FILE_CASES = {
    # name: (file text, command builder, expected fragment)
    "not_utf8": (b"name: \xff\xfe\n", lambda p: ["plan", "--cluster", p, "--model", "gpt-1.3b", "--global-batch",
                                                   "8"], "not UTF-8"),
    "deep_json": ("[" * 5000 + "]" * 5000, lambda p: ["show", p], "nested too deeply"),
    "deep_yaml": ("a:\n" + "".join(" " * i + "- \n" for i in range(1, 3)) + "[" * 5000 + "]" * 5000,
                  lambda p: ["plan", "--cluster", p, "--model", "gpt-1.3b", "--global-batch", "8"], "cluster"),
    "huge_int": ('{"schema_version": ' + "9" * 5000 + "}", lambda p: ["show", p],
                 "huge_int.json: holds an integer of over 4300 digits; no field takes one"),
    "huge_int_yaml": ("name: x\nnodes: [{host: a, device_type: T4, count: " + "9" * 5000 + "}]\n",
                      lambda p: PLAN_ARGS[:2] + [p] + PLAN_ARGS[3:], "holds an integer of over 4300 digits"),
    # YAML reads 1e-300 (no dot) as a string: it said "input should be a valid dictionary"
    "peak_tiny": (cluster_with(**{"device_types.MY-GPU.peak_tflops": 1e-300}),
                  lambda p: PLAN_ARGS[:2] + [p] + PLAN_ARGS[3:], "peak_tflops.bf16: must be > 1e-06 TFLOP/s"),
    "peak_tiny_yaml": ("name: x\ndevice_types: {G: {vendor: nvidia, peak_tflops: 1e-300, memory_gib: 24, "
                       "memory_gbps: 900}}\nnodes: [{host: a, device_type: G, count: 1}]\n",
                       lambda p: PLAN_ARGS[:2] + [p] + PLAN_ARGS[3:], "peak_tflops.bf16: must be > 1e-06 TFLOP/s"),
    "peak_word": ("name: x\ndevice_types: {G: {vendor: nvidia, peak_tflops: fast, memory_gib: 24, "
                  "memory_gbps: 900}}\nnodes: [{host: a, device_type: G, count: 1}]\n",
                  lambda p: PLAN_ARGS[:2] + [p] + PLAN_ARGS[3:],
                  "peak_tflops: expected TFLOP/s (a number) or a map dtype -> TFLOP/s, got 'fast'"),
    "memory_gbps_tiny": (cluster_with(**{"device_types.MY-GPU.memory_gbps": 1e-300}),
                         lambda p: PLAN_ARGS[:2] + [p] + PLAN_ARGS[3:], "memory_gbps"),
    "count_1e12": (cluster_with(**{"nodes.0.count": 10 ** 12}), lambda p: PLAN_ARGS[:2] + [p] + PLAN_ARGS[3:],
                   "cluster.nodes[0].count: must be <= 65536"),
    "count_1e9_total": (cluster_with(nodes=[{"host": f"h{i}", "device_type": "A100-80GB", "count": 60000}
                                            for i in range(3)]),
                        lambda p: PLAN_ARGS[:2] + [p] + PLAN_ARGS[3:], "at most 65536 devices"),
    "link_tiny": (cluster_with(**{"network.inter_node_gbps": 1e-300}), lambda p: PLAN_ARGS[:2] + [p] + PLAN_ARGS[3:],
                  "inter_node_gbps"),
    "latency_inf": (cluster_with(**{"network.inter_node_latency_us": float("inf")}),
                    lambda p: PLAN_ARGS[:2] + [p] + PLAN_ARGS[3:], "inter_node_latency_us"),
    # host names reach a generated hostfile and ssh/pdsh: a second hostfile line or an ssh flag is refused
    "host_newline": (cluster_with(**{"nodes.0.host": "n2 slots=64\nevil"}),
                     lambda p: PLAN_ARGS[:2] + [p] + PLAN_ARGS[3:], "cluster.nodes[0].host: 'n2 slots=64\\nevil' is "
                                                                    "not a host name"),
    "host_ssh_flag": (cluster_with(**{"nodes.1.host": "-oProxyCommand=touch /tmp/x"}),
                      lambda p: PLAN_ARGS[:2] + [p] + PLAN_ARGS[3:], "cluster.nodes[1].host: '-oProxyCommand"),
    "long_host": (cluster_with(**{"nodes.0.host": "h" * 100_000}), lambda p: PLAN_ARGS[:2] + [p] + PLAN_ARGS[3:],
                  "at most 256 characters"),
    "layers_1e9": ("name: m\narchitecture: gpt\nnum_layers: 1000000000\nhidden_size: 64\nnum_attention_heads: 4\n"
                   "ffn_hidden_size: 256\nvocab_size: 100\nseq_length: 16\n",
                   lambda p: ["plan", "--cluster", CLUSTER, "--model", p, "--global-batch", "8"],
                   "num_layers: must be <= 10000"),
    # an alias bomb in a wrongly typed field: the echo stays short however large the value grows
    "alias_bomb": ("a: &a [x, x, x, x, x, x, x, x, x]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]\n"
                   "c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b]\nd: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c]\n"
                   "name: [*d, *d, *d, *d, *d, *d, *d, *d, *d]\nnodes: [{host: a, device_type: T4, count: 1}]\n",
                   lambda p: PLAN_ARGS[:2] + [p] + PLAN_ARGS[3:], "cluster.name"),
}


@pytest.mark.parametrize("name", sorted(FILE_CASES))
def test_bad_files_are_one_line(tmp_path, capsys, name):
    text, argv, fragment = FILE_CASES[name]
    path = write(tmp_path, name + (".json" if name in ("deep_json", "huge_int") else ".yaml"), text)
    line = cli_error(capsys, argv(path))
    assert fragment in line, line


FLAG_CASES = {
    "global_batch_1e30": (PLAN_ARGS[:6] + ["1" + "0" * 30], "--global-batch: must be in 1..10000000"),
    "max_units_0": (PLAN_ARGS + ["--max-units", "0"], "--max-units: must be in 3.."),
    "max_units_2": (PLAN_ARGS + ["--max-units", "2"], "--max-units: must be in 3.."),
    "reserve_negative": (PLAN_ARGS + ["--memory-reserve-gib", "-1000"], "--memory-reserve-gib: must be in [0"),
    "time_limit_nan": (PLAN_ARGS + ["--time-limit", "nan"], "--time-limit: must be in (0"),
    "max_micro_batch_0": (PLAN_ARGS + ["--max-micro-batch", "0"], "--max-micro-batch: must be in 1.."),
    "too_many_micro_batches": (PLAN_ARGS[:6] + ["9000000", "--max-micro-batch", "8"],
                               "global_batch: 9000000 needs more than 100000 micro-batches"),
    "output_is_input": (PLAN_ARGS + ["-o", CLUSTER], "--output: "),
    "output_directory": (PLAN_ARGS + ["-o", EXAMPLES], "is a directory"),
    "output_missing_folder": (PLAN_ARGS + ["-o", "/nonexistent-folder/plan.json"], "does not exist"),
    "output_device": (PLAN_ARGS + ["-o", os.devnull], "is not a regular file"),
    "trace_over_plan": (["simulate", PLAN, "--trace", PLAN], "--trace: "),
    "missing_schedule": (["simulate", PLAN, "--schedule", "/nonexistent.txt"], "--schedule: cannot read"),
    "plan_is_a_directory": (["show", EXAMPLES], "plan: '" + EXAMPLES + "' is a directory, not a file"),
    "cluster_is_a_directory": (["plan", "--cluster", EXAMPLES] + PLAN_ARGS[3:], "cluster: '" + EXAMPLES
                               + "' is a directory, not a file"),
}


@pytest.mark.parametrize("name", sorted(FLAG_CASES))
def test_bad_flags_are_one_line(capsys, name):
    argv, fragment = FLAG_CASES[name]
    assert fragment in cli_error(capsys, argv)


def test_error_lines_of_ranks_sharing_one_pipe_never_glue_together():
    """Four processes print errors at once into one stderr pipe, as the ranks of one launch do: each line
    must arrive whole (``print`` writes text and newline apart, and lines got glued: ``...3error: ...``)."""
    code = ("import sys, time\nfrom hethub.partitioner import print_error\n"
            "time.sleep(max(0.0, float(sys.argv[2]) - time.time()))  # all start together\n"
            "for i in range(1000): print_error(f'rank {sys.argv[1]} line {i} ' + 'x' * 60)")
    read_fd, write_fd = os.pipe()
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + SITE)
    start = str(time.time() + 2.0)
    procs = [subprocess.Popen([sys.executable, "-c", code, str(r), start], stderr=write_fd, env=env)
             for r in range(4)]
    os.close(write_fd)
    with os.fdopen(read_fd) as pipe:
        lines = pipe.read().splitlines()
    assert [p.wait(timeout=60) for p in procs] == [0] * 4
    assert len(lines) == 4000 and all(l.startswith("error: rank ") and l.count("error:") == 1 for l in lines)


HETERO_CASES = {  # (ds_config, HETHUB_EMULATE_SLOWDOWN, the line's start[, HETHUB_EMULATE_PROFILES])
    "misspelt_key": ({"hetero": {"timout_s": 10}}, "", "error: config.hetero.timout_s: unknown field"),
    "negative_timeout": ({"hetero": {"timeout_s": -1}}, "", "error: config.hetero.timeout_s: must be >= 1, got -1"),
    "tiny_timeout": ({"hetero": {"timeout_s": 1e-9}}, "", "error: config.hetero.timeout_s: must be >= 1, got 1e-09"),
    "hetero_list": ({"hetero": []}, "", "error: config.hetero: expected an object of hethub's settings, got list"),
    "timeout_not_a_number": ({"hetero": {"timeout_s": "soon"}}, "", "error: config.hetero.timeout_s: "),
    "slowdown_below_1": ({"hetero": {"emulate_slowdown": {"SLOW": 0.5}}}, "",
                         "error: config.hetero.emulate_slowdown.SLOW: must be in [1, 10000], got 0.5"),
    "section_not_a_dict": ({"hetero": "plan.json"}, "", "error: config.hetero: "),
    "bf16_and_fp16": ({"bf16": {"enabled": True}, "fp16": {"enabled": True}}, "",
                      "error: config.fp16.enabled: bf16 and fp16 are both enabled"),
    "fp16_scale_power": ({"fp16": {"enabled": True, "initial_scale_power": 400}}, "",
                         "error: config.fp16.initial_scale_power: "),
    "fp16_window_0": ({"fp16": {"enabled": True, "loss_scale_window": 0}}, "", "error: config.fp16.loss_scale_window: "),
    "bf16_not_a_dict": ({"bf16": True}, "", "error: config.bf16: expected an object"),
    "env_not_type_factor": ({}, "SLOW", "error: HETHUB_EMULATE_SLOWDOWN: 'SLOW' is not TYPE=FACTOR"),
    "env_factor_0": ({}, "SLOW=0", "error: HETHUB_EMULATE_SLOWDOWN: SLOW: factor must be in [1, 10000], got 0"),
    "pin_profiles_missing": ({}, "", "error: HETHUB_EMULATE_PROFILES: no such directory '/nonexistent/profiles'",
                             "/nonexistent/profiles"),
}


@pytest.mark.parametrize("name", sorted(HETERO_CASES))
def test_bad_hetero_section_is_one_line_before_anything_starts(capsys, monkeypatch, name):
    """hethub.initialize checks ds_config's "hetero" section (and the slowdown variable) before any collective."""
    import hethub
    config, env, line, *pins = HETERO_CASES[name]
    monkeypatch.setenv("HETHUB_EMULATE_SLOWDOWN", env)
    monkeypatch.setenv("HETHUB_EMULATE_PROFILES", pins[0] if pins else "")
    with pytest.raises(SystemExit) as exc:
        hethub.initialize(layers=[], config=config, plan=PLAN)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1 and err.startswith(line), err


def test_hetero_section_defaults_and_json_round_trip():
    from hethub.runtime.startup import DEFAULT_TIMEOUT_S, HeteroSection, hetero_section
    assert hetero_section({}) == HeteroSection() and HeteroSection().timeout_s == DEFAULT_TIMEOUT_S
    section = hetero_section({"hetero": {"plan": PLAN, "timeout_s": 30, "emulate_slowdown": {"SLOW": 3}}})
    assert section.timeout_s == 30.0 and section.emulate_slowdown == {"SLOW": 3.0}
    assert HeteroSection.model_validate_json(section.model_dump_json()) == section


def test_brute_force_keeps_the_time_limit(tmp_path, capsys):
    line = cli_error(capsys, ["plan", "--cluster", CLUSTER, "--model", "llama-7b", "--global-batch", "64",
                              "--solver", "brute-force", "--time-limit", "1", "--no-compare",
                              "-o", str(tmp_path / "p.json")])
    assert "brute force did not finish within 1 s" in line


def test_the_time_limit_is_the_commands_its_start_up_and_finish_included(monkeypatch):
    """`plan --time-limit` bounds the command, not only the search: what the command spent before it (the
    interpreter, imports, the inputs) and what it does after (``FINISH_S``) come off the planner's limit (768
    devices, `--schedule 1f1b --time-limit 10`: 10.6 s before, 9.7-9.8 s after). Never below half of it; a command
    function called directly (no start marked) keeps the whole limit."""
    import time

    from hethub.cli import clock
    from hethub.cli.plan import FINISH_S, _time_left_s
    assert clock._process_age_s() > 0 or not os.path.exists("/proc/self/stat")
    clock.clear()
    assert _time_left_s(10.0) == 10.0
    monkeypatch.setitem(clock._STARTED, "s", time.perf_counter() - 1.0)
    assert 10.0 - 1.0 - FINISH_S - 0.5 < _time_left_s(10.0) <= 10.0 - 1.0 - FINISH_S
    assert _time_left_s(1.0) == 0.5
    clock.mark_start(shell=False)
    assert _time_left_s(10.0) == pytest.approx(10.0 - FINISH_S, abs=0.5)
    clock.clear()


def test_all_zero_profile_times_are_refused(tmp_path):
    prof = json.loads(subprocess.run([sys.executable, "-c", "from hethub.partitioner import builtin_model;"
                                      "print(builtin_model('gpt-tiny').to_json())"], capture_output=True, text=True,
                                     cwd=ROOT).stdout)
    data = {"device_type": "T4", "model": prof, "micro_batch_size": 1,
            "layers": [{"index": i, "kind": k, "forward_ms": 0, "backward_ms": 0}
                       for i, k in enumerate(["embedding"] + ["block"] * prof["num_layers"] + ["head"])]}
    with pytest.raises(InputError, match=r"layers\[0\].forward_ms: must be > 0"):
        load_profile(write(tmp_path, "p.json", json.dumps(data)))


def test_a_failed_write_leaves_the_old_file_and_no_partial_one(tmp_path):
    target = tmp_path / "plan.json"
    target.write_text("old")

    def broken(tmp):
        with open(tmp, "w") as f:
            f.write("partial")
        raise OSError(28, "No space left on device")
    with pytest.raises(InputError, match="--output: cannot write .* No space left on device"):
        write_atomic(str(target), broken, "--output")
    assert target.read_text() == "old"
    assert os.listdir(tmp_path) == ["plan.json"]


@pytest.mark.parametrize("blocked,argv,fragment", [
    ("matplotlib", ["simulate", PLAN, "--png", "{tmp}/t.png"], '--png: needs matplotlib, which this install lacks: pip install -e ".[plot]"'),
    ("deepspeed", ["launch", "--hetero-plan", PLAN, os.path.join(EXAMPLES, "train_gpt.py")],  # a dry run needs none
     'launch: needs deepspeed, which this install lacks: pip install -e ".[runtime]"'),
])
def test_missing_optional_packages_name_the_extra(tmp_path, blocked, argv, fragment):
    code = (f"import sys; sys.modules[{blocked!r}] = None\n"
            "from hethub.cli import main; sys.exit(main(sys.argv[1:]))")
    r = subprocess.run([sys.executable, "-c", code, *[a.replace("{tmp}", str(tmp_path)) for a in argv]],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    err = r.stderr.strip()
    assert r.returncode == 2 and "\n" not in err and err.startswith(f"error: {fragment} in hethub's checkout"), err


# ------------------------------------------------------------------ property test: no loader ever escapes

JSONISH = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
                       lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=12), c, max_size=4),
                       max_leaves=20)
LOADERS = {"cluster": (load_cluster, CLUSTER), "model": (load_model, os.path.join(EXAMPLES, "model.yaml")),
           "plan": (load_plan, PLAN)}


def _paths(data, prefix=()):
    yield prefix
    if isinstance(data, dict):
        for k, v in data.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(data, list):
        for i, v in enumerate(data):
            yield from _paths(v, prefix + (i,))


def _set(data, path, value):
    if not path:
        return value
    node = data
    for p in path[:-1]:
        node = node[p]
    node[path[-1]] = value
    return data


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kind=st.sampled_from(sorted(LOADERS)), value=JSONISH, pick=st.integers(min_value=0))
def test_random_mutations_of_valid_files_load_or_give_one_line(tmp_path, kind, value, pick):
    loader, example = LOADERS[kind]
    with open(example) as f:
        data = yaml.safe_load(f)
    paths = list(_paths(data))
    mutated = _set(data, paths[pick % len(paths)], value)
    path = tmp_path / f"m.{'json' if kind == 'plan' else 'yaml'}"
    path.write_text(json.dumps(mutated))
    try:
        loader(str(path))
    except InputError as exc:
        text = str(exc)
        assert "\n" not in text and len(text) < 600, text


# ---- a new user's paths (each failed before its fix)
LLAMA_CFG = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
             "intermediate_size": 128, "vocab_size": 100}


@pytest.mark.parametrize("change, says", [
    ("add 1000000000 V100-32GB", "a count is at most 65536"),  # was a loop building 10^8 nodes (a hang)
    ("add " + "9" * 5000 + " V100-32GB", "a count is at most 65536"),  # was int()'s traceback
    ("add 65530 A100-80GB", "add 1 to 65524 devices"),  # past the cluster's limit with its 12
])
def test_what_if_counts_are_bounded(tmp_path, capsys, change, says):
    line = cli_error(capsys, ["plan", "--cluster", CLUSTER, "--model", "llama-7b", "--global-batch", "64",
                              "--what-if", change, "-o", str(tmp_path / "p.json")])
    assert line.startswith("error: --what-if:") and says in line, line


@pytest.mark.parametrize("extra, field, says", [
    ({"model_type": ["llama"]}, "model.model_type", "got ['llama']"),
    ({"max_position_embeddings": 64, "tie_word_embeddings": "false"}, "model.tie_word_embeddings",
     "must be true or false, got 'false'"),  # bool("false") tied the weights
])
def test_bad_hf_config_fields(tmp_path, capsys, extra, field, says):
    cfg = write(tmp_path, "config.json", json.dumps({**LLAMA_CFG, **extra}))
    line = cli_error(capsys, ["plan", "--cluster", CLUSTER, "--model", f"hf:{cfg}", "--global-batch", "8",
                              "-o", str(tmp_path / "p.json")])
    assert line.startswith(f"error: {field}:") and says in line, line


def test_seq_length_supplies_a_missing_context_and_plans_are_world_readable(tmp_path, capsys):
    cfg = write(tmp_path, "config.json", json.dumps(LLAMA_CFG))  # no max_position_embeddings
    out = tmp_path / "p.json"
    old = os.umask(0o022)
    try:
        rc = main(["plan", "--cluster", CLUSTER, "--model", f"hf:{cfg}", "--seq-length", "64", "--global-batch",
                   "8", "--time-limit", "5", "--no-compare", "-o", str(out)])
    finally:
        os.umask(old)
    assert rc == 0, capsys.readouterr()
    assert json.loads(out.read_text())["model"]["seq_length"] == 64
    assert os.stat(out).st_mode & 0o777 == 0o644  # mkstemp's 0600 hid plans from a cluster's other users


def test_interrupt_during_comparisons_leaves_no_plan(tmp_path, capsys, monkeypatch):
    import hethub.cli.plan as cli_plan

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(cli_plan, "_compare", interrupted)
    out = tmp_path / "p.json"
    rc = main(["plan", "--cluster", CLUSTER, "--model", "llama-7b", "--global-batch", "64", "--time-limit", "5",
               "-o", str(out)])
    assert rc == 130 and "interrupted" in capsys.readouterr().err
    assert not out.exists() and os.listdir(tmp_path) == []


@pytest.mark.parametrize("argv", [["profile", "--model", "gpt-tiny", "--device-type", "A100-80GB"], ["demo"]])
def test_planning_only_install_names_the_extra(tmp_path, argv):
    """Before: ModuleNotFoundError's traceback; the old hint named a package index hethub is not on."""
    code = ("import sys; sys.modules['torch'] = None; sys.modules['deepspeed'] = None\n"
            "from hethub.cli.main import main; sys.exit(main(sys.argv[1:]))")
    r = subprocess.run([sys.executable, "-c", code, *argv, "-o", str(tmp_path / "out")], capture_output=True,
                       text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr[-800:]
    assert r.stderr.startswith(f"error: {argv[0]}: needs torch") and 'pip install -e ".[runtime]"' in r.stderr
    assert not (tmp_path / "out").exists()


BOMB = "".join(f"l{k}: &l{k} [{', '.join([f'*l{k - 1}'] * 10) if k else ', '.join(['x'] * 10)}]\n" for k in range(7))


@pytest.mark.parametrize("where, body", [
    ("cluster name", BOMB + "name: *l6\nnodes: [{host: a, device_type: A100-80GB, count: 1}]\n"),
    ("cluster count", BOMB + "name: x\nnodes: [{host: a, device_type: A100-80GB, count: *l6}]\n"),
    ("model name", BOMB + "name: *l6\narchitecture: gpt\nnum_layers: 2\nhidden_size: 8\n"),
    ("recursive", "name: &n [1, *n]\n"),
])
def test_yaml_alias_bombs_are_refused_before_they_are_expanded(tmp_path, capsys, where, body):
    """Seven lines of aliases stand for 10**7 values: every reader refuses them in one line, unexpanded."""
    path = write(tmp_path, "in.yaml", body)
    loader = load_model if where.startswith("model") else load_cluster
    t0 = time.perf_counter()
    with pytest.raises(InputError, match=r"aliases expand to over 1000000 values|an alias refers to a node that "
                                         r"contains it"):
        loader(path)
    assert time.perf_counter() - t0 < 5
    assert main(["show", path]) == 2 and capsys.readouterr().err.count("\n") == 1


def test_ctrl_c_at_any_moment_of_a_plan_is_one_line(tmp_path):
    """SIGINT while the command imports, builds its candidates or solves: one line, exit 130 (a HiGHS callback
    used to turn it into a 40-line TypeError traceback; during the imports PuLP swallowed it importing HiGHS, and the
    plan went on without HiGHS, or ended in a traceback, or CPython ended the process by SIGINT after the line).
    Each delay counts from the command's first own import (``-X importtime`` says when), where its handler is in
    place: counted from the process's start, a loaded machine (a CI suite run) let 0.12 s land in Python's own
    start-up (site, .pth files, runpy), before any program's code runs."""
    import signal
    cluster = os.path.join(EXAMPLES, "cluster.yaml")
    for delay_s in (0.0, 0.05, 0.1, 0.15, 0.2, 0.5, 1.4, 2.9):
        proc = subprocess.Popen([sys.executable, "-X", "importtime", "-m", "hethub.cli", "plan", "--cluster", cluster,
                                 "--model", "llama-7b", "--global-batch", "512", "--time-limit", "30", "-o",
                                 str(tmp_path / "p.json")],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT)
        while "hethub.partitioner" not in proc.stderr.readline():  # the command's own imports have begun
            assert proc.poll() is None, proc.stderr.read()[-2000:]
        # read on while waiting: a full pipe of import lines would stall the command at its next import, and the
        # later delays would interrupt that stall instead of the search
        said: list = []
        reader = threading.Thread(target=lambda: said.extend(proc.stderr), daemon=True)
        reader.start()
        time.sleep(delay_s)
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
        reader.join(10)
        lines = [line.rstrip("\n") for line in said if not line.startswith("import time:")]
        if proc.returncode == 0 and delay_s >= 2.9:
            continue  # it finished before the signal (a 30 s solve ignoring Ctrl-C would end 0 too: not before)
        assert proc.returncode == 130 and lines[-1:] == ["error: interrupted"], (delay_s, "\n".join(lines)[-2000:])
        assert all(not line.startswith(("Traceback", "  File")) for line in lines), (delay_s, "\n".join(lines)[-2000:])
        assert not (tmp_path / "p.json").exists()  # nothing half-written


@pytest.mark.skipif(not os.path.isdir("/proc") or not hasattr(os, "fork"), reason="needs /proc and fork")
def test_ctrl_c_while_the_comparisons_run_beside_the_search_ends_both_in_one_line(tmp_path):
    """The comparisons run in a forked process beside the search (its command line the same): Ctrl-C to the
    command is one line, exit 130, and the forked process goes with it."""
    import signal
    out = str(tmp_path / "p.json")
    err = tmp_path / "err.txt"
    with open(err, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "hethub.cli", "plan", "--cluster",
                                 os.path.join(EXAMPLES, "cluster.yaml"), "--model", "llama-7b", "--global-batch",
                                 "512", "--time-limit", "30", "-o", out], stdout=subprocess.DEVNULL, stderr=f, cwd=ROOT)
    deadline = time.monotonic() + 60
    while len(_running(out)) < 2:  # the comparisons' process has started
        assert proc.poll() is None and time.monotonic() < deadline, err.read_text()[-2000:]
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) == 130 and err.read_text().strip().splitlines() == ["error: interrupted"], \
        err.read_text()[-2000:]
    assert _running(out) == [] and not os.path.exists(out)


def _running(tag: str) -> list[str]:
    """Processes whose command line holds ``tag`` (zombies, which are gone but for their exit code, left out)."""
    return [pid for pid in os.listdir("/proc") if pid.isdigit() and tag in _cmdline(pid)]


def _cmdline(pid: str) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode(errors="replace")
    except OSError:  # it ended meanwhile
        return ""


REWORDED = """
import sys
import hethub.cli
entry = hethub.cli.main  # the console script's function (importing hethub.cli.main rebinds the name)
import hethub.cli.main as commands
from hethub.cli import interrupts

def import_interrupted(argv):
    try:
        interrupts.on_interrupt(2, None)
    except KeyboardInterrupt:
        raise RuntimeError('Error building "default" validator: KeyboardInterrupt') from None

def in_a_weakref_callback(callback):  # as importlib's module-lock clean-up runs: Python cannot raise from there
    import weakref
    class Lock:
        pass
    lock = Lock()
    ref = weakref.ref(lock, lambda _ref: callback())
    del lock
    return 0

def interrupted_in_a_callback(argv):
    return in_a_weakref_callback(lambda: interrupts.on_interrupt(2, None))

def unraisable_bug(argv):
    return in_a_weakref_callback(lambda: 1 / 0)

class PanicException(BaseException):  # pyo3's, which pydantic-core raises when its Rust code panics
    pass

def panicked(argv):  # Ctrl-C cut pydantic-core's import of datetime: it panics ("PyCapsule_Import could not ...")
    try:
        interrupts.on_interrupt(2, None)
    except KeyboardInterrupt:
        raise PanicException('PyErr { type: ImportError, value: ImportError("PyCapsule_Import could not import '
                             'module datetime") }') from None

def panic_bug(argv):
    raise PanicException("called `Option::unwrap()` on a `None` value")

commands.main = {"interrupt": import_interrupted, "bug": lambda argv: 1 / 0, "callback": interrupted_in_a_callback,
                 "callback-bug": unraisable_bug, "panic": panicked, "panic-bug": panic_bug}[sys.argv[1]]
sys.exit(entry(["plan"]))
"""


@pytest.mark.parametrize("case", ["interrupt", "bug", "callback", "callback-bug", "panic", "panic-bug"])
def test_an_interrupt_a_library_rewords_while_the_command_imports_is_one_line(case):
    """Ctrl-C while pydantic builds a model's validator at import reaches the entry as a SchemaError wrapping the
    KeyboardInterrupt (once in 60 runs of the test above): it was a traceback and exit 1, not the line and 130.
    Ctrl-C landing in a weakref callback (importlib's module-lock clean-up; once in a suite run of the test above)
    was Python's "Exception ignored in:" and a traceback before the line; cutting pydantic-core's import of datetime
    made its Rust code panic (a BaseException; once in a suite run): a traceback and exit 1. Any other exception
    still ends in its traceback, an unraisable one and a panic included."""
    r = subprocess.run([sys.executable, "-c", REWORDED, case], capture_output=True, text=True, cwd=ROOT, timeout=60)
    if case in ("interrupt", "callback", "panic"):
        assert r.returncode == 130 and r.stderr.splitlines() == ["error: interrupted"], r.stderr[-2000:]
    elif case == "bug":
        assert r.returncode == 1 and "ZeroDivisionError" in r.stderr, r.stderr[-2000:]
    elif case == "panic-bug":
        assert r.returncode == 1 and "PanicException: called `Option::unwrap()`" in r.stderr, r.stderr[-2000:]
    else:
        assert r.returncode == 0 and "Exception ignored" in r.stderr and "ZeroDivisionError" in r.stderr, r.stderr


def test_a_profiles_folder_may_hold_other_json_files(tmp_path):
    """`--profiles demo-out` read every JSON there as a profile (its model.json: "device_type: is required")."""
    from hethub.partitioner.records import load_profiles
    with pytest.raises(InputError, match="--profiles: no profile"):
        load_profiles(str(tmp_path))
    (tmp_path / "model.json").write_text(json.dumps({"name": "m", "architecture": "gpt"}))
    (tmp_path / "plan.json").write_text(json.dumps({"schema_version": 1, "stages": []}))
    (tmp_path / "train-log.json").write_text(json.dumps([{"step": 0, "loss": 6.4}]))  # the demo's log: a list
    with pytest.raises(InputError, match="--profiles: no profile"):
        load_profiles(str(tmp_path))
    (tmp_path / "broken.json").write_text(json.dumps({"device_type": "A100-80GB"}))  # a profile, missing fields
    with pytest.raises(InputError, match="broken.json"):
        load_profiles(str(tmp_path))
