"""The model a user names on the command line: a built-in name, a YAML/JSON file, or a Hugging Face config.

Apart from ``records`` because reading a Hugging Face config is its own format (``partitioner.hf``), which builds
a ``ModelConfig`` record: records stay the vocabulary both sides share.
"""
from __future__ import annotations

import os
from typing import Optional

from .errors import InputError
from .hf import load_hf_model
from .records import MODELS, ModelConfig, builtin_model, parse_record, read_data_file


def load_model(spec: str, seq_length: Optional[int] = None) -> ModelConfig:
    """A built-in model name (``gpt-1.3b``), a YAML/JSON file path, or ``hf:path/config.json`` (a Hugging Face
    config, see ``partitioner.hf``); ``seq_length`` (``--seq-length``) replaces the model's, and supplies a
    Hugging Face config's when it names no maximum context."""
    if spec.startswith("hf:"):
        return load_hf_model(spec[3:], seq_length=seq_length)
    model = _load_model(spec)
    if seq_length is None:
        return model
    return parse_record(ModelConfig, {**model.model_dump(), "seq_length": seq_length}, "--seq-length")


def _load_model(spec: str) -> ModelConfig:
    if spec in MODELS:
        return builtin_model(spec)
    if not os.path.exists(spec):
        raise InputError("model", f"no file and no built-in model named {spec!r} (built-in: {', '.join(MODELS)})")
    data = read_data_file(spec, "model")
    if isinstance(data, dict) and "name" not in data:
        data = {"name": os.path.splitext(os.path.basename(spec))[0], **data}
    return parse_record(ModelConfig, data, "model")
