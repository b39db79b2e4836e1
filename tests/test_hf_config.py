"""Tier 1: the planner's model from a Hugging Face config.json (pure: no transformers import)."""
import json

import pytest

from hethub.cli.main import main
from hethub.partitioner import InputError
from hethub.partitioner.costmodel import layer_costs
from hethub.partitioner.hf import load_hf_model, model_config_from_hf
from hethub.partitioner.loaders import load_model

GPT2 = {"model_type": "gpt2", "n_layer": 12, "n_embd": 768, "n_head": 12, "n_inner": None, "vocab_size": 50257,
        "n_positions": 1024, "tie_word_embeddings": True}
LLAMA3_8B = {"model_type": "llama", "num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
             "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256,
             "max_position_embeddings": 8192, "tie_word_embeddings": False}


def test_gpt2_small_is_124m_with_tied_embeddings():
    m = model_config_from_hf(GPT2, "gpt2")
    assert (m.architecture, m.num_layers, m.ffn_hidden_size, m.seq_length, m.tie_embeddings) == \
        ("gpt", 12, 3072, 1024, True)
    from hethub.partitioner.costmodel import CostModel
    from instances import MIXED
    cm = CostModel(MIXED, m)
    n = m.num_planner_layers
    assert 123e6 < cm.stage_params(0, n) < 126e6  # GPT-2 small: 124.4M (tied head counted once)
    # split between stages, both ends hold the tied weight, and its gradient is all-reduced between them
    vh = m.vocab_size * m.hidden_size
    assert cm.stage_params(0, 1) + cm.stage_params(1, n) == pytest.approx(cm.stage_params(0, n) + vh)
    assert cm.tied_params(0, 1) == cm.tied_params(n - 1, n) == vh and cm.tied_params(0, n) == 0
    assert cm.tied_params(1, n - 1) == 0


def test_llama3_8b_is_8b_with_gqa(tmp_path):
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text(json.dumps(LLAMA3_8B))
    m = load_model(f"hf:{tmp_path / 'llama'}")  # a folder as save_pretrained writes it
    assert m.name == "llama" and m.kv_heads == 8 and m.architecture == "llama"
    assert 7.9e9 < layer_costs(m).params.sum() < 8.1e9  # Llama-3-8B: 8.03B
    assert load_hf_model(str(tmp_path / "llama" / "config.json"), seq_length=2048).seq_length == 2048


@pytest.mark.parametrize("cfg,fragment", [
    ({**GPT2, "model_type": "t5"}, "model.model_type: hethub plans gpt2, llama, mistral, qwen2 models, got 't5'"),
    ({k: v for k, v in LLAMA3_8B.items() if k != "intermediate_size"}, "model.intermediate_size: is required"),
    ({**LLAMA3_8B, "num_key_value_heads": 5}, "num_key_value_heads: must divide"),
])
def test_bad_configs_are_one_line(cfg, fragment):
    with pytest.raises(InputError) as exc:
        model_config_from_hf(cfg)
    assert fragment in str(exc.value)


def test_cli_plans_for_an_hf_config(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(GPT2))
    out = tmp_path / "plan.json"
    rc = main(["plan", "--cluster", "examples/cluster.yaml", "--model", f"hf:{path}", "--seq-length", "512",
               "--global-batch", "32", "--no-compare", "--time-limit", "5", "-o", str(out)])
    assert rc == 0, capsys.readouterr().err
    plan = json.loads(out.read_text())
    assert plan["model"]["seq_length"] == 512 and plan["model"]["tie_embeddings"] is True
