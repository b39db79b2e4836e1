"""Hugging Face causal LMs as hethub pipelines (hethub.hf): the layer list computes what the model computes,
and under a plan it trains like the model in one process — GPT-2 with its tied embedding/head across
stages, Llama with rotary embeddings and grouped-query attention — and a tied checkpoint resumes under a
plan that places the tie's ends elsewhere."""
import functools
import os
import sys

import pytest
import torch

from conftest import ROOT
from dist_util import spawn

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


def _plan(kind, cuts, splits, mb, M):
    from hethub.hf import model_config
    from hethub.partitioner.placement import StageLayout, build_plan
    from test_runtime import CPU_CLUSTER
    m = model_config(train_hf.make_model(kind), seq_length=train_hf.SEQ)
    bounds = [0, *cuts, m.num_planner_layers]
    return build_plan(m, CPU_CLUSTER, [StageLayout((bounds[i], bounds[i + 1]), "CPU", tuple(s))
                                       for i, s in enumerate(splits)], mb, M)


def _run(tmp_path, plan, name, steps, kind, *extra):
    path = str(tmp_path / f"{name}.json")
    with open(path, "w") as f:
        f.write(plan.to_json())
    out = str(tmp_path / f"{name}{{rank}}.pt")
    for rank, (rc, _o, err) in enumerate(spawn(plan.world_size, [WORKER, path, out, str(steps), kind, *extra],
                                               timeout=120)):
        assert rc == 0, f"rank {rank}:\n{err[-3000:]}"
    return [torch.load(out.replace("{rank}", str(r)), weights_only=True) for r in range(plan.world_size)]


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
@pytest.mark.parametrize("kind,layout", [("gpt2", GPT2_2TO3), ("llama", ([2], [[4], [2, 2]], 4, 2))],
                         ids=["gpt2-2to3", "llama-gqa-1to2"])
def test_hf_model_trains_like_one_process(tmp_path, kind, layout):
    plan = _plan(kind, *layout)
    ref = _reference(kind, *layout[2:], STEPS)
    assert ref["losses"][-1] < ref["losses"][0]  # it learns
    _compare(_run(tmp_path, plan, "p", STEPS, kind), ref, ref["losses"])
    if kind == "gpt2":  # both ends of the tie hold the same, trained weight
        n = plan.model.num_planner_layers
        assert torch.equal(ref["params"]["0.tokens.weight"], ref["params"][f"{n - 1}.lm_head.weight"])


@pytest.mark.dist
def test_tied_gpt2_resumes_under_a_plan_that_moves_the_tie(tmp_path):
    """1 -> 2 (uneven) -> 1 for K steps, checked against one process, saved (the tied weight stored once);
    2 -> 3 resumes for K more (the tie's ends now on stages 0 and 1): as if never interrupted."""
    K, ckpt = 3, str(tmp_path / "ckpt")
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


def test_pipeline_layers_compute_what_the_model_computes():
    from hethub.hf import causal_lm_loss, model_config, pipeline_layers
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
    from hethub.hf import pipeline_layers
    with pytest.raises(ValueError, match=r"model: hethub.hf knows GPT2LMHeadModel, LlamaForCausalLM, "
                                         r"MistralForCausalLM, Qwen2ForCausalLM, got Linear"):
        pipeline_layers(torch.nn.Linear(2, 2))
