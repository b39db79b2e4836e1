"""``hethub export hf``: a hethub checkpoint back into a Hugging Face folder that ``from_pretrained`` loads.

Why: a Hugging Face user starts from pretrained weights (``hethub.hf.from_pretrained``) and wants a model folder
back, not hethub's per-layer files. hethub's checkpoint stores planner layer i's ``state_dict`` as the layer of
``pipeline_layers(model)`` holds it (the wrappers hold the model's own modules), so the export builds the model
from the folder's ``config.json``, loads each layer file into its wrapper (every file checked against the digest
``meta.json`` holds, loaded as data), and writes the model with ``save_pretrained`` as safetensors. A tied weight
(GPT-2's ``lm_head`` and ``wte``) is stored once by hethub and stays one tensor. The tokenizer's and generation
files of the source folder are copied; weights in it are not. The output is written into a temporary folder
and renamed into place: it exists whole or not at all, and never replaces an existing path.
"""
from __future__ import annotations

import os
import shutil
import sys
from typing import Callable, Optional

import torch

from ..partitioner.errors import InputError
from ..runtime.checkpoint import layer_file, load_layer_file, read_meta, resolve_tag
from .hf import from_config_folder, model_config, pipeline_layers

_WEIGHTS = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack")
_MODEL_FILES = ("config.json", "model.safetensors.index.json", "pytorch_model.bin.index.json")


def export_hf(checkpoint_dir: str, model_folder: str, out: str, tag: Optional[str] = None,
              say: Callable[[str], None] = print) -> str:
    """Write ``out``, a Hugging Face folder of ``model_folder``'s model with the weights of ``checkpoint_dir``'s
    checkpoint (``tag``, else the newest complete one); returns the tag exported."""
    out = os.path.abspath(out)
    for what, path in (("CHECKPOINT_DIR", checkpoint_dir), ("--model", model_folder)):
        if os.path.abspath(path) == out:
            raise InputError("-o", f"{out[:100]!r} is the {what}: write the export to a new folder")
    if os.path.lexists(out):
        raise InputError("-o", f"{out[:100]!r} exists: the export writes a new folder and never replaces one")
    tag = resolve_tag(checkpoint_dir, tag, say)
    d = os.path.join(checkpoint_dir, tag)
    meta = read_meta(d)
    model = from_config_folder(model_folder)
    _check_same_model(meta, model)
    _load_layers(model, d, meta["digests"])
    tmp = os.path.join(os.path.dirname(out), f".tmp-{os.path.basename(out)}-{os.getpid()}")
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        _copy_side_files(model_folder, tmp)
        os.rename(tmp, out)
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp)
    return tag


def _check_same_model(meta: dict, model) -> None:
    saved, mine = meta["model"], model_config(model).model_dump()
    for key in ("num_layers", "hidden_size", "vocab_size"):
        if saved.get(key) != mine.get(key):
            raise InputError("--model", f"the checkpoint holds a model with {key}={saved.get(key)}, the folder's "
                                        f"config.json has {key}={mine.get(key)}")


def _load_layers(model, d: str, digests: dict) -> None:
    """Each planner layer's file into its wrapper; a key a file lacks must be a weight tied to one loaded."""
    states = [load_layer_file(layer_file(d, idx, "model"), digests) for idx in range(len(pipeline_layers(model)))]
    floats = [v.dtype for st in states for v in st.values() if torch.is_tensor(v) and v.is_floating_point()]
    if floats:  # the dtype it was trained in (the folder's config may say another)
        model.to(floats[0])
    loaded: set[int] = set()
    missing: list[tuple[int, str, torch.Tensor]] = []
    for idx, (layer, state) in enumerate(zip(pipeline_layers(model), states)):
        own = layer.state_dict(keep_vars=True)
        extra = sorted(set(state) - set(own))
        if extra:
            raise InputError("checkpoint", f"layer {idx}: {extra[0]!r} is not a weight of the model's layer {idx} "
                                           f"({type(layer).__name__})")
        for k, v in own.items():
            if k not in state:
                missing.append((idx, k, v))
                continue
            if tuple(state[k].shape) != tuple(v.shape):
                raise InputError("checkpoint", f"layer {idx}.{k}: shape {tuple(state[k].shape)} in the checkpoint, "
                                               f"{tuple(v.shape)} in the model")
            with torch.no_grad():
                v.copy_(state[k].to(v.dtype))
            loaded.add(id(v))
    for idx, k, v in missing:
        if id(v) not in loaded:
            raise InputError("checkpoint", f"layer {idx}: {k!r} missing in {layer_file(d, idx, 'model')[:120]}")


def _copy_side_files(folder: str, tmp: str) -> None:
    """The tokenizer's and generation files beside the weights (never weights, never the model's own config)."""
    src = folder if os.path.isdir(folder) else os.path.dirname(os.path.abspath(folder))
    for name in sorted(os.listdir(src)):
        path = os.path.join(src, name)
        if (os.path.isfile(path) and not os.path.islink(path) and not name.endswith(_WEIGHTS)
                and name not in _MODEL_FILES and not os.path.exists(os.path.join(tmp, name))):
            shutil.copyfile(path, os.path.join(tmp, name))


def main_export_hf(checkpoint_dir: str, model: str, out: str, tag: Optional[str]) -> int:
    """The CLI's ``export hf``: one line on success, to stderr what resolve_tag says."""
    folder = model[3:] if model.startswith("hf:") else model
    tag = export_hf(checkpoint_dir, folder, out, tag, say=lambda m: print(m, file=sys.stderr))
    print(f"wrote {out} (checkpoint {tag!r} of {checkpoint_dir}): AutoModelForCausalLM.from_pretrained({out!r})")
    return 0
