"""The planner's model from a Hugging Face ``config.json`` (``hethub plan --model hf:path/config.json``).

Pure: reads the JSON ``transformers`` writes, never imports ``transformers``. Why: a fleet's owner starts
from a Hugging Face model, and planning must run on a laptop without torch. Field names follow each
``transformers`` configuration class (``GPT2Config``: n_layer, n_embd, ...; ``LlamaConfig`` and its
relatives: num_hidden_layers, hidden_size, ...). The sequence length is the config's maximum
context (``n_positions`` / ``max_position_embeddings``) unless ``seq_length`` is given: training
usually runs shorter sequences than the model's maximum, and activations grow with it.
"""
from __future__ import annotations

import os
from typing import Any, Optional

from .errors import InputError
from .records import ModelConfig, parse_record, read_data_file

# model_type -> architecture of the planner's cost model (llama: RMSNorm, SwiGLU, GQA, no biases)
SUPPORTED = {"gpt2": "gpt", "llama": "llama", "mistral": "llama", "qwen2": "llama"}


def model_config_from_hf(cfg: dict[str, Any], name: str = "hf-model", seq_length: Optional[int] = None
                         ) -> ModelConfig:
    """ModelConfig from a config.json dict; one InputError naming the field on anything missing or unknown."""
    if not isinstance(cfg, dict):
        raise InputError("model", f"a Hugging Face config.json holds an object, got {type(cfg).__name__}")
    kind = cfg.get("model_type")
    if not isinstance(kind, str) or kind not in SUPPORTED:
        raise InputError("model.model_type", f"hethub plans {', '.join(sorted(SUPPORTED))} models, got {kind!r}")

    def field(*names: str, default: Any = None) -> Any:
        for n in names:
            if cfg.get(n) is not None:
                return cfg[n]
        if default is not None:
            return default
        raise InputError(f"model.{names[0]}", f"is required in a {kind} config.json")

    def flag(name: str, default: bool) -> bool:
        value = cfg.get(name, default)
        if not isinstance(value, bool):  # bool("false") is True: a string here would silently tie weights
            raise InputError(f"model.{name}", f"must be true or false, got {str(value)[:40]!r}")
        return value

    def context(*names: str) -> Any:  # --seq-length says what is trained at; only without it is the config asked
        return seq_length if seq_length is not None else field(*names)

    if kind == "gpt2":
        hidden = field("n_embd", "hidden_size")
        data = {"architecture": "gpt", "num_layers": field("n_layer", "num_hidden_layers"), "hidden_size": hidden,
                "num_attention_heads": field("n_head", "num_attention_heads"),
                "ffn_hidden_size": field("n_inner", default=4 * hidden if isinstance(hidden, int) else None),
                "vocab_size": field("vocab_size"), "seq_length": context("n_positions", "n_ctx"),
                "tie_embeddings": flag("tie_word_embeddings", True)}
    else:
        data = {"architecture": "llama", "num_layers": field("num_hidden_layers"), "hidden_size": field("hidden_size"),
                "num_attention_heads": field("num_attention_heads"),
                "num_key_value_heads": cfg.get("num_key_value_heads"),
                "ffn_hidden_size": field("intermediate_size"), "vocab_size": field("vocab_size"),
                "seq_length": context("max_position_embeddings"),
                "tie_embeddings": flag("tie_word_embeddings", False)}
    return parse_record(ModelConfig, {"name": name, **data}, "model")


def load_hf_model(path: str, seq_length: Optional[int] = None) -> ModelConfig:
    """``path`` is a config.json, or a folder holding one (as ``save_pretrained`` writes it)."""
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    name = os.path.basename(os.path.dirname(os.path.abspath(path))) or "hf-model"
    return model_config_from_hf(read_data_file(path, "model"), name=name, seq_length=seq_length)
