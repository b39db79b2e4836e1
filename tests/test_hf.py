"""Hugging Face causal LMs as hethub pipelines (hethub.hf): the layer list computes what the model computes,
and under a plan it trains like the model in one process — GPT-2 with its tied embedding/head across
stages, Llama with rotary embeddings and grouped-query attention — and a tied checkpoint resumes under a
plan that places the tie's ends elsewhere."""
import functools
import json
import os
import sys

import pytest
import torch

from conftest import ROOT, SITE
from dist_util import run_plan

transformers = pytest.importorskip("transformers")
sys.path.insert(0, os.path.join(ROOT, "tests", "workers"))
import train_hf  # noqa: E402

WORKER = os.path.join("tests", "workers", "train_hf.py")
STEPS = 5
# float64 model; Hugging Face's loss (and hethub's, to match it) runs in fp32: ~1e-7 relative per step
TOL = 1e-5


@functools.lru_cache(maxsize=None)
def _reference(kind, mb, M, steps):
    torch.set_num_threads(1)
    return train_hf.reference(kind, mb, M, steps)


def _plan(kind, cuts, splits, mb, M, tps=None):
    from hethub.models.hf import model_config
    from hethub.partitioner.placement import StageLayout, build_plan
    from plans import CPU_CLUSTER
    m = model_config(train_hf.make_model(kind), seq_length=train_hf.SEQ)
    bounds = [0, *cuts, m.num_planner_layers]
    tps = tps or [1] * len(splits)
    return build_plan(m, CPU_CLUSTER, [StageLayout((bounds[i], bounds[i + 1]), "CPU", tuple(s), tensor_parallel=t)
                                       for i, (s, t) in enumerate(zip(splits, tps))], mb, M)


def _run(tmp_path, plan, name, steps, kind, *extra):
    return run_plan(tmp_path, plan, name, WORKER, str(steps), kind, *extra)


def _compare(got, ref, losses):
    seen = set()
    for rank, g in enumerate(got):
        torch.testing.assert_close(g["losses"], losses, rtol=TOL, atol=0)
        torch.testing.assert_close(g["eval_loss"], ref["eval_loss"], rtol=TOL, atol=0)
        for k, v in g["params"].items():
            torch.testing.assert_close(v, ref["params"][k], rtol=0, atol=TOL, msg=f"rank {rank} {k}")
            seen.add(k)
    assert seen == set(ref["params"])


GPT2_1TO2TO1 = ([1, 3], [[6], [4, 2], [6]], 6, 2)  # 1 -> 2 (uneven) -> 1: the tie spans stages 0 and 2
GPT2_2TO3 = ([2], [[3, 3], [2, 2, 2]], 6, 2)        # the tied weight on stages of widths 2 and 3


@pytest.mark.dist
@pytest.mark.parametrize("kind,layout", [("llama", ([2], [[4], [2, 2]], 4, 2, [1, 2]))],
                         ids=["llama-gqa-1to2-tensor-parallel-2"])  # GPT-2 2->3: the resume test's second half
def test_hf_model_trains_like_one_process(tmp_path, kind, layout):
    plan = _plan(kind, *layout)
    ref = _reference(kind, *layout[2:4], STEPS)
    assert ref["losses"][-1] < ref["losses"][0]  # it learns
    _compare(_run(tmp_path, plan, "p", STEPS, kind), ref, ref["losses"])


@pytest.mark.dist
def test_tied_gpt2_resumes_under_a_plan_that_moves_the_tie(tmp_path):
    """1 -> 2 (uneven) -> 1 for K steps, checked against one process, saved (the tied weight stored once);
    2 -> 3 resumes for K more (the tie's ends now on stages 0 and 1): as if never interrupted, and both ends
    of the tie hold the same trained weight."""
    K, ckpt = 5, str(tmp_path / "ckpt")
    ref = _reference("gpt2", 6, 2, 2 * K)
    first = _run(tmp_path, _plan("gpt2", *GPT2_1TO2TO1), "a", K, "gpt2", "--save", ckpt)
    for g in first:
        torch.testing.assert_close(g["losses"], ref["losses"][:K], rtol=TOL, atol=0)
    with open(os.path.join(ckpt, "latest")) as f:
        tag = f.read().strip()
    n = 5
    head = torch.load(os.path.join(ckpt, tag, f"layer_{n - 1:02d}-model_states.pt"), weights_only=True)
    assert "lm_head.weight" not in head and "norm.weight" in head  # stored once, with the embedding
    second = _run(tmp_path, _plan("gpt2", *GPT2_2TO3), "b", 2 * K, "gpt2", "--first", str(K), "--load", ckpt)
    _compare(second, ref, ref["losses"][K:])
    assert torch.equal(ref["params"]["0.tokens.weight"], ref["params"][f"{n - 1}.lm_head.weight"])
    tied = [g["params"] for g in second if "0.tokens.weight" in g["params"] or f"{n - 1}.lm_head.weight" in g["params"]]
    ends = [p.get("0.tokens.weight", p.get(f"{n - 1}.lm_head.weight")) for p in tied]
    assert len(ends) >= 2 and all(torch.equal(e, ends[0]) for e in ends)


def test_pipeline_layers_compute_what_the_model_computes():
    from hethub.models.hf import causal_lm_loss, model_config, pipeline_layers
    for kind in ("gpt2", "llama"):
        model = train_hf.make_model(kind)
        ids = torch.randint(0, train_hf.VOCAB, (3, train_hf.SEQ), generator=torch.Generator().manual_seed(0))
        ref = model(input_ids=ids, labels=ids)
        x = ids
        layers = pipeline_layers(model)
        assert len(layers) == model_config(model).num_planner_layers
        for layer in layers:
            x = layer(x)
        torch.testing.assert_close(x, ref.logits, rtol=0, atol=1e-12)
        torch.testing.assert_close(causal_lm_loss(x, ids), ref.loss, rtol=1e-6, atol=0)
    assert model_config(train_hf.make_model("gpt2")).tie_embeddings
    assert not model_config(train_hf.make_model("llama")).tie_embeddings


def test_an_unknown_model_class_is_named_with_the_supported_ones():
    from hethub.models.hf import pipeline_layers
    with pytest.raises(ValueError, match=r"model: hethub.hf knows GPT2LMHeadModel, LlamaForCausalLM, "
                                         r"MistralForCausalLM, Qwen2ForCausalLM, got Linear"):
        pipeline_layers(torch.nn.Linear(2, 2))


def _example(*args, timeout=120):
    import subprocess
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", PYTHONPATH=ROOT + os.pathsep + SITE)
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def _example_plan(tmp_path):
    from conftest import run_cli
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text("name: cpu3\ndevice_types:\n  CPU: {vendor: cpu, peak_tflops: {fp32: 1}, memory_gib: 8, "
                       "memory_gbps: 20}\nnodes:\n  - {host: localhost, device_type: CPU, count: 3}\n")
    r = run_cli("plan", "--cluster", str(cluster), "--model", "hf:examples/hf-gpt2-tiny", "--seq-length", "32",
                "--global-batch", "8", "--no-compare", "-o", str(tmp_path / "plan.json"))
    assert r.returncode == 0, r.stderr
    return str(tmp_path / "plan.json")


def test_example_refuses_a_model_class_hethub_does_not_know(tmp_path):
    (tmp_path / "bert").mkdir()
    (tmp_path / "bert" / "config.json").write_text(json.dumps({
        "model_type": "bert", "architectures": ["BertLMHeadModel"], "vocab_size": 256, "hidden_size": 64,
        "num_hidden_layers": 4, "num_attention_heads": 4, "intermediate_size": 128, "is_decoder": True}))
    r = _example("examples/train_hf.py", "--hetero-plan", _example_plan(tmp_path), "--model", str(tmp_path / "bert"),
                 "--text", "README.md")
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip().splitlines()[-1] == ("error: model: hethub.hf knows GPT2LMHeadModel, LlamaForCausalLM, "
                                                 "MistralForCausalLM, Qwen2ForCausalLM, got BertLMHeadModel")


@pytest.mark.dist
def test_example_trains_gpt2_from_a_config_under_hethub_launch(tmp_path):
    """The README's commands: plan from the config.json, launch the example on a text file (3 stages, the tie
    across stages 0 and 2); the loss falls."""
    r = _example("-m", "hethub.cli", "launch", "--hetero-plan", _example_plan(tmp_path), "--local",
                 "examples/train_hf.py", "--model", "examples/hf-gpt2-tiny", "--text", "README.md", "--steps", "4")
    assert r.returncode == 0, r.stderr[-3000:]
    losses = [json.loads(line)["loss"] for line in r.stdout.splitlines() if line.startswith('{"step"')]
    assert len(losses) == 4 and losses[-1] < losses[0], r.stdout[-2000:]


def test_tied_layer_specs_share_one_module_and_are_found_as_ties():
    from deepspeed.pipe import LayerSpec, TiedLayerSpec
    from hethub.models.ties import find_ties, resolve_tied_specs
    emb = TiedLayerSpec("embed", torch.nn.Linear, 4, 4)
    head = TiedLayerSpec("embed", torch.nn.Linear, 4, 4, forward_fn=lambda m, x: x @ m.weight)
    layers = resolve_tied_specs([emb, LayerSpec(torch.nn.Linear, 4, 4), head])
    assert isinstance(layers[1], LayerSpec)  # plain specs stay lazy
    assert layers[2].module is layers[0]  # one module per key; its own forward_fn
    x = torch.randn(2, 4)
    torch.testing.assert_close(layers[2](x), x @ layers[0].weight)
    ties = find_ties(layers)
    assert [t.places for t in ties] == [((0, "bias"), (2, "module.bias")), ((0, "weight"), (2, "module.weight"))]
    assert ties[1].owner == (0, "weight")


def _pretrained_folder(tmp_path, kind):
    """A local 'pretrained' folder: the test's model with weights no seed gives (a pretrained run's), saved by
    Hugging Face as safetensors with a tokenizer file beside it."""
    model = train_hf.make_model(kind)
    with torch.no_grad():
        g = torch.Generator().manual_seed(3)
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    folder = tmp_path / f"{kind}-pretrained"
    model.save_pretrained(str(folder), safe_serialization=True)
    (folder / "tokenizer_config.json").write_text("{}")
    return str(folder)


@pytest.mark.dist
@pytest.mark.parametrize("kind,layout", [("gpt2", ([1, 3], [[6], [4, 2], [6]], 6, 2)),
                                         ("llama", ([2], [[4], [2, 2]], 4, 2))], ids=["gpt2-tied", "llama"])
def test_pretrained_weights_in_trained_under_a_plan_and_exported_back_to_hugging_face(tmp_path, kind, layout):
    """From a local pretrained folder (hethub.hf.from_pretrained) to a plan's run (its losses are the pretrained
    model's, trained in one process), to `hethub export hf`: AutoModelForCausalLM.from_pretrained loads the
    export, its weights are the checkpoint's, and its logits are the one-process trained model's."""
    from conftest import run_cli
    pre, steps = _pretrained_folder(tmp_path, kind), 3
    ref = train_hf.reference(kind, *layout[2:4], steps, pretrained=pre)
    got = _run(tmp_path, _plan(kind, *layout), "p", steps, kind, "--pretrained", pre, "--save",
               str(tmp_path / "ckpt"))
    for g in got:
        torch.testing.assert_close(g["losses"], ref["losses"], rtol=TOL, atol=0)
    out = tmp_path / "exported"
    r = run_cli("export", "hf", str(tmp_path / "ckpt"), "--model", f"hf:{pre}", "-o", str(out))
    assert r.returncode == 0 and r.stdout.startswith(f"wrote {out}"), r.stderr
    assert (out / "model.safetensors").is_file() and (out / "tokenizer_config.json").read_text() == "{}"
    exported = transformers.AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True)
    assert next(exported.parameters()).dtype == torch.float64  # the dtype it trained in
    from hethub.models.hf import pipeline_layers
    tag = (tmp_path / "ckpt" / "latest").read_text().strip()
    for i, layer in enumerate(pipeline_layers(exported)):
        saved = torch.load(str(tmp_path / "ckpt" / tag / f"layer_{i:02d}-model_states.pt"), weights_only=True)
        for k, v in saved.items():
            assert torch.equal(layer.state_dict()[k], v), f"layer {i} {k}"
    trained = train_hf.load(kind, pre)
    trained_layers = pipeline_layers(trained)
    with torch.no_grad():
        for i, layer in enumerate(trained_layers):
            layer.load_state_dict({k[len(f"{i}."):]: v for k, v in ref["params"].items() if k.startswith(f"{i}.")})
        ids = train_hf.batch(-1, 4)
        torch.testing.assert_close(exported(input_ids=ids).logits, trained(input_ids=ids).logits, rtol=TOL, atol=TOL)
    if kind == "gpt2":  # the tie kept: one tensor
        assert exported.lm_head.weight.data_ptr() == exported.transformer.wte.weight.data_ptr()
    again = run_cli("export", "hf", str(tmp_path / "ckpt"), "--model", f"hf:{pre}", "-o", str(out))
    assert again.returncode == 2 and again.stderr.startswith("error: -o: ") and "exists" in again.stderr
