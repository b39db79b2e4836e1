"""Tensor parallelism inside a stage, on PyTorch's tensor-parallel API.

Why PyTorch's API (``parallelize_module`` with ``ColwiseParallel``/``RowwiseParallel`` on a ``DeviceMesh``
made from the replica's own process group) for hethub's and the user's layers, rather than megatron-core's
parallel layers: it splits a module already built, in place, and hethub's groups are per stage and per
replica (stages differ in width and degree), which a ``DeviceMesh.from_group`` expresses directly. It
also takes a user's plan in the strings Hugging Face uses (``base_model_tp_plan``: "colwise" /
"rowwise") and runs on CPU/gloo, so equivalence is tested where CI runs. megatron-core's own layers run
tensor-parallel too, rebuilt with the replica's group (``hethub.models.megatron``): megatron-core 0.16 takes
per-module process groups (``pg_collection``), which is the seam a per-stage group needs.

A layer may split itself: one that defines ``split_tensor_parallel(group)`` replaces its parameters by
this rank's shards and marks each split one with ``mark_split(param, group, dim, parts)`` (``parts`` > 1
for matrices that are several matrices stacked, like a fused SwiGLU input, each split on its own).

What is split: hethub's own blocks (``hethub.models.builtin.Block.TP_PLAN``: Q, K, V and the first MLP matrices
column-parallel, the output projections row-parallel); a user's layers where ``tp_plan`` patterns
(fnmatch over ``"{layer index}.{submodule path}"``) match. Everything else — embeddings, norms, heads,
unmatched submodules — runs replicated on every rank of the group. A stage's output must leave it whole
(pair every column-parallel matrix with a row-parallel one inside the stage), since only the group's lead
sends it on.

Parameters split by the plan are DTensors (or marked plain tensors); ``local`` gives the rank's own shard for hethub's all-reduces,
clipping, ZeRO-1 and checkpoints, and ``is_sharded`` says whether a tensor is split (its norm counts on
every rank of the group) or whole (counted once).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from fnmatch import fnmatch
from typing import Any, Mapping, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..models.builtin import Block, Embedding, Head
from ..partitioner.errors import InputError

STYLES = ("colwise", "rowwise")
DTENSOR_MODULE = "torch.distributed.tensor"


def is_dtensor(t: Any) -> bool:
    """Whether ``t`` is a DTensor, without importing ``torch.distributed.tensor`` (0.4 s of every worker's start-up,
    most of which never split a layer): no DTensor can exist before that module is imported."""
    module = sys.modules.get(DTENSOR_MODULE)
    return module is not None and isinstance(t, module.DTensor)


def from_local(part: torch.Tensor, like: Any) -> Any:
    """A DTensor laid out as the DTensor ``like``, holding ``part`` as this rank's shard."""
    return type(like).from_local(part, like.device_mesh, like.placements, run_check=False)
SELF = "self"  # a layer with split_tensor_parallel(group): it splits itself


@dataclass(frozen=True)
class Split:
    """How a plain tensor is one rank's shard of a whole one: ``parts`` stacked blocks along ``dim``, each
    cut into ``group``-size equal chunks, this rank keeping its chunk of every block."""
    group: Any
    dim: int
    parts: int = 1


def mark_split(param: torch.Tensor, group: Any, dim: int, parts: int = 1) -> None:
    """Mark ``param`` as this rank's shard (see ``Split``) so hethub reduces, clips, shards (ZeRO-1) and
    checkpoints it as a split tensor."""
    param._hethub_split = Split(group, dim, parts)


def split_of(t: torch.Tensor) -> Optional[Split]:
    return getattr(t, "_hethub_split", None)


def check_tp_plan(tp_plan: Optional[Mapping[str, str]]) -> dict[str, str]:
    """``tp_plan`` as a dict of fnmatch pattern -> "colwise" | "rowwise"; one InputError naming the entry."""
    if tp_plan is None:
        return {}
    if not isinstance(tp_plan, Mapping):
        raise InputError("tp_plan", f"expected a dict of pattern -> 'colwise' | 'rowwise', got {type(tp_plan).__name__}")
    for pattern, style in tp_plan.items():
        if not isinstance(pattern, str) or not pattern:
            raise InputError("tp_plan", f"patterns are non-empty strings, got {pattern!r}"[:120])
        if style not in STYLES:
            raise InputError(f"tp_plan[{pattern[:60]!r}]", f"expected 'colwise' or 'rowwise', got {style!r}"[:120])
    return dict(tp_plan)


def _known_plan(layer: nn.Module) -> Optional[dict[str, str]]:
    """hethub's own layers: blocks split per ``Block.TP_PLAN``; embedding and head run whole."""
    if isinstance(layer, Block):
        names = dict(layer.named_modules())
        return {path: style for path, style in Block.TP_PLAN.items() if path in names}
    if isinstance(layer, (Embedding, Head)) or type(layer).__name__ in (
            "HFEmbedding", "HFHead", "MegatronEmbedding", "MegatronHead"):
        return {}  # embeddings and heads run whole on every rank of the group
    return None


def layer_plan(idx: int, layer: Any, tp_plan: Mapping[str, str]) -> tuple[Optional[dict[str, str]], set[str]]:
    """(submodule path -> style for this layer, the patterns that matched). None: no plan at all (neither
    a pattern matches nor does hethub know the layer)."""
    if not isinstance(layer, nn.Module):
        return {}, set()  # a plain function: nothing to split
    if callable(getattr(layer, "split_tensor_parallel", None)):
        return {"": SELF}, set()  # it splits itself; patterns do not reach inside
    out, used = {}, set()
    for path, _ in layer.named_modules():
        key = f"{idx}.{path}" if path else str(idx)
        for pattern, style in tp_plan.items():
            if fnmatch(key, pattern):
                out[path] = style
                used.add(pattern)
                break
    if out:
        return out, used
    known = _known_plan(layer)
    if known is None and not any(p.requires_grad for p in layer.parameters()):
        return {}, used  # nothing to train, nothing to split (activations, reshapes)
    return known, used


def check_layers(plan, layers: Sequence[Any], tp_plan: Mapping[str, str]) -> None:
    """Before any collective: every layer of a stage with tensor_parallel > 1 has a plan (hethub's own or a
    pattern), and every pattern matches something in such a stage."""
    tp_stages = [st for st in plan.stages if st.tensor_parallel > 1]
    if not tp_stages:
        return
    matched: set[str] = set()
    for st in tp_stages:
        for idx in (i for a, b in st.chunk_ranges for i in range(a, b)):
            if type(layers[idx]).__name__ in ("LayerSpec", "TiedLayerSpec"):
                raise InputError(f"layers[{idx}]", f"stage {st.index} runs tensor-parallel; pass the module itself "
                                                   f"rather than a LayerSpec, so its plan can be checked")
            found, used = layer_plan(idx, layers[idx], tp_plan)
            matched |= used
            if found is None:
                raise InputError(f"layers[{idx}]", f"{type(layers[idx]).__name__} in stage {st.index} "
                                                   f"(tensor_parallel {st.tensor_parallel}) has no tensor-parallel "
                                                   f"plan: hethub splits its own GPT/Llama blocks; for other layers "
                                                   f"pass tp_plan={{'{idx}.<submodule>': 'colwise'|'rowwise'}}")
    unused = [p for p in tp_plan if p not in matched]
    if unused:
        raise InputError(f"tp_plan[{unused[0][:60]!r}]", "matches no submodule of a stage with tensor_parallel > 1 "
                                                         "(keys are '{layer index}.{submodule path}')")


def parallelize(first_idx: int, layers: Sequence[Any], tp_plan: Mapping[str, str], mesh) -> None:
    """Split this stage's layers in place over ``mesh`` (this replica's tensor-parallel group)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module  # lazy: 0.4 s at start-up
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    for k, layer in enumerate(layers):
        found, _ = layer_plan(first_idx + k, layer, tp_plan)
        if not found:
            continue
        if found == {"": SELF}:
            layer.split_tensor_parallel(mesh.get_group())
        elif "" in found:  # the layer itself (a Linear)
            parallelize_module(layer, mesh, styles[found[""]]())
        else:
            parallelize_module(layer, mesh, {path: styles[s]() for path, s in found.items()})


def is_sharded(t: torch.Tensor) -> bool:
    """A DTensor split over its mesh, or a tensor marked by ``mark_split`` (its rank holds a part)."""
    return split_of(t) is not None or (is_dtensor(t) and any(p.is_shard() for p in t.placements))


def local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds: a DTensor's own shard (the same storage), anything else as is."""
    if is_dtensor(t):
        with torch.no_grad():
            return t.to_local()
    return t


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor (collective over the group for a split one: every rank of it must call)."""
    if is_dtensor(t):
        with torch.no_grad():
            return t.full_tensor()
    return gather_like(t, t)


def gather_like(v: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """The whole of ``v``, this rank's shard laid out as the marked plain tensor ``p`` (``v`` may be ``p``
    or optimizer state shaped like it); anything else as is. Collective over the group."""
    split = split_of(p)
    if split is None or v.dim() == 0 or tuple(v.shape) != tuple(p.shape):
        return v
    with torch.no_grad():
        chunks = [torch.empty_like(v) for _ in range(dist.get_world_size(split.group))]
        dist.all_gather(chunks, v.detach().contiguous(), group=split.group)
        blocks = [[c.chunk(split.parts, dim=split.dim)[k] for c in chunks] for k in range(split.parts)]
        return torch.cat([torch.cat(b, dim=split.dim) for b in blocks], dim=split.dim)


def shard_of(whole: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """This rank's part of a whole tensor, laid out as ``like`` (a DTensor or a marked tensor) is: no
    communication."""
    split = split_of(like)
    if split is not None and whole.dim() > 0:
        n, r = dist.get_world_size(split.group), dist.get_rank(split.group)
        return torch.cat([b.chunk(n, dim=split.dim)[r] for b in whole.chunk(split.parts, dim=split.dim)],
                         dim=split.dim)
    if not is_dtensor(like):
        return whole
    part = whole
    for mesh_dim, placement in enumerate(like.placements):
        if placement.is_shard():
            n = like.device_mesh.size(mesh_dim)
            part = part.chunk(n, dim=placement.dim)[like.device_mesh.get_local_rank(mesh_dim)]
    return part


def place_shard(whole: torch.Tensor, part: torch.Tensor, like: torch.Tensor) -> None:
    """Write this rank's ``part`` into its place in ``whole`` (the inverse of ``shard_of``; ``like`` says the
    layout): no communication."""
    split = split_of(like)
    if split is not None and whole.dim() > 0:
        n, r = dist.get_world_size(split.group), dist.get_rank(split.group)
        for block, piece in zip(whole.chunk(split.parts, dim=split.dim), part.chunk(split.parts, dim=split.dim)):
            block.chunk(n, dim=split.dim)[r].copy_(piece)
        return
    view = whole
    if is_dtensor(like):
        for mesh_dim, placement in enumerate(like.placements):
            if placement.is_shard():
                n = like.device_mesh.size(mesh_dim)
                view = view.chunk(n, dim=placement.dim)[like.device_mesh.get_local_rank(mesh_dim)]
    view.copy_(part)
