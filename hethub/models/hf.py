"""Hugging Face causal LMs as hethub pipelines: ``pipeline_layers(model)``, ``causal_lm_loss``, ``model_config``.

Why a layer list: hethub cuts a model between planner layers (embedding, one per decoder block, head), so
the model must exist as that list. Each piece here wraps the model's own modules (no copy: the
parameters are the model's), and each block wrapper rebuilds what ``*Model.forward`` would hand the
block — the causal mask (through ``transformers.masking_utils``, so every attention implementation gets
the mask it expects, sliding windows included), position ids, and for rotary models the
``position_embeddings`` from the model's own rotary module — so a pipeline computes what the model does.

GPT-2 ties ``lm_head.weight`` to ``wte.weight``: the embedding and head pieces share that Parameter, and
hethub's runtime finds the tie by identity and keeps both ends in step (``hethub.models.ties``).

Supported (random init from a config is enough; nothing is downloaded): ``GPT2LMHeadModel``,
``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM``. Weights: ``from_pretrained(folder)`` starts
from a local pretrained folder's (safetensors); ``hethub export hf`` writes a trained checkpoint back as one
(``hf_export``).
"""
from __future__ import annotations

import os
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..partitioner.errors import InputError
from ..partitioner.hf import model_config_from_hf
from ..partitioner.records import ModelConfig

SUPPORTED = ("GPT2LMHeadModel", "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


def _position_ids(x: torch.Tensor) -> torch.Tensor:
    return torch.arange(x.shape[1], device=x.device).unsqueeze(0)


class HFEmbedding(nn.Module):
    """Token embedding (+ learned positions and dropout for GPT-2): input ids -> hidden states."""

    def __init__(self, tokens: nn.Module, positions: Optional[nn.Module] = None, dropout: Optional[nn.Module] = None):
        super().__init__()
        self.tokens, self.positions, self.dropout = tokens, positions, dropout

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.tokens(input_ids)
        if self.positions is not None:
            x = x + self.positions(_position_ids(input_ids))
        return self.dropout(x) if self.dropout is not None else x


class HFBlock(nn.Module):
    """One decoder block, called as its model calls it: causal mask, position ids, rotary embeddings."""

    def __init__(self, block: nn.Module, config: Any, rotary: Optional[nn.Module] = None, sliding: bool = False):
        super().__init__()
        self.block, self.rotary, self.sliding = block, rotary, sliding
        self._config = config  # not a module: kept out of state_dict

    def _mask(self, x: torch.Tensor, position_ids: torch.Tensor):
        from transformers import masking_utils
        make = masking_utils.create_sliding_window_causal_mask if self.sliding else masking_utils.create_causal_mask
        return make(config=self._config, inputs_embeds=x, attention_mask=None, cache=None, position_ids=position_ids)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        position_ids = _position_ids(x)
        kwargs = {"attention_mask": self._mask(x, position_ids), "position_ids": position_ids}
        if self.rotary is not None:
            kwargs["position_embeddings"] = self.rotary(x, position_ids=position_ids)
        out = self.block(x, **kwargs)
        return out[0] if isinstance(out, tuple) else out


class HFHead(nn.Module):
    """Final norm + LM head: hidden states -> logits."""

    def __init__(self, norm: nn.Module, lm_head: nn.Module):
        super().__init__()
        self.norm, self.lm_head = norm, lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(x))


def _folder(path: str) -> str:
    folder = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise InputError("model", f"no config.json in {folder[:100]!r}")
    return folder


def _quiet_transformers():
    import transformers
    transformers.logging.set_verbosity_error()
    return transformers


def from_pretrained(path: str, dtype: Optional[torch.dtype] = None) -> nn.Module:
    """A local pretrained folder's model with its weights (``AutoModelForCausalLM.from_pretrained``, local files
    only, safetensors only: a pickled ``pytorch_model.bin`` is not loaded), ready for ``pipeline_layers``.
    Every rank loads the same weights, so the plan's stages start from them."""
    folder = _folder(path)
    transformers = _quiet_transformers()
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, use_safetensors=True,
                                                                  dtype=dtype)
    except (OSError, ValueError, KeyError) as exc:
        raise InputError("model", f"{folder[:100]}: {str(exc).splitlines()[0][:200]}") from None
    _supported_input(model)
    return model


def _supported_input(model: Any) -> None:
    try:
        _check_supported(model)
    except ValueError as exc:
        raise InputError("model", str(exc).split(": ", 1)[1]) from None


def from_config_folder(path: str) -> nn.Module:
    """The model a folder's ``config.json`` describes, random init (``AutoModelForCausalLM.from_config``)."""
    folder = _folder(path)
    transformers = _quiet_transformers()
    try:
        config = transformers.AutoConfig.from_pretrained(folder, local_files_only=True)
        model = transformers.AutoModelForCausalLM.from_config(config)
    except (OSError, ValueError, KeyError) as exc:
        raise InputError("model", f"{folder[:100]}: {str(exc).splitlines()[0][:200]}") from None
    _supported_input(model)
    return model


def _check_supported(model: Any) -> str:
    name = type(model).__name__
    if name not in SUPPORTED:
        raise ValueError(f"model: hethub.hf knows {', '.join(SUPPORTED)}, got {name}")
    return name


def pipeline_layers(model: nn.Module) -> list[nn.Module]:
    """The model as hethub's layer list: [embedding, one per decoder block, final norm + LM head].

    The list order is the planner's layer list of ``model_config(model)``. Dropout modules stay as the
    model has them (set the config's dropout probabilities to 0 for runs that must match exactly).
    """
    name = _check_supported(model)
    cfg = model.config
    if name == "GPT2LMHeadModel":
        t = model.transformer
        blocks = [HFBlock(b, cfg) for b in t.h]
        return [HFEmbedding(t.wte, t.wpe, t.drop), *blocks, HFHead(t.ln_f, model.lm_head)]
    m = model.model
    kinds = getattr(cfg, "layer_types", None) or []
    mistral_sliding = name == "MistralForCausalLM" and getattr(cfg, "sliding_window", None) is not None
    blocks = [HFBlock(b, cfg, m.rotary_emb, sliding=mistral_sliding or (i < len(kinds) and kinds[i] == "sliding_attention"))
              for i, b in enumerate(m.layers[:cfg.num_hidden_layers])]
    return [HFEmbedding(m.embed_tokens), *blocks, HFHead(m.norm, model.lm_head)]


def tp_plan(model: nn.Module) -> Optional[dict[str, str]]:
    """The model's own ``base_model_tp_plan`` ("layers.*.self_attn.q_proj": "colwise", ...) as a ``tp_plan`` for
    ``hethub.initialize`` over ``pipeline_layers(model)`` (patterns over "{layer index}.block.{path}"); None
    when the model has none (GPT-2's fused attention matrix has no column split by heads)."""
    _check_supported(model)
    base = getattr(model.config, "base_model_tp_plan", None) or {}
    out = {}
    for key, style in base.items():
        if key.startswith("layers.*.") and style in ("colwise", "rowwise"):
            out["*.block." + key[len("layers.*."):]] = style
    return out or None


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Hugging Face's causal-LM loss: labels are the input ids (as ``model(input_ids=ids, labels=ids)`` takes
    them), shifted here by one; -100 is ignored; mean over the labelled tokens, in fp32.

    hethub weights each replica's mean by its share of the samples, so a run equals one process exactly
    when every sequence has the same number of labelled tokens (no padding), as in the tests.
    """
    shifted = F.pad(labels, (0, 1), value=-100)[..., 1:]
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), shifted.reshape(-1), ignore_index=-100)


def model_config(model_or_config: Any, seq_length: Optional[int] = None) -> ModelConfig:
    """The planner's ModelConfig of a ``transformers`` model, its config object, or a config.json dict."""
    if isinstance(model_or_config, nn.Module):
        _check_supported(model_or_config)
        model_or_config = model_or_config.config
    cfg = model_or_config if isinstance(model_or_config, dict) else model_or_config.to_dict()
    name = cfg.get("_name_or_path") or cfg.get("model_type") or "hf-model"
    return model_config_from_hf(cfg, name=str(name)[:100], seq_length=seq_length)
