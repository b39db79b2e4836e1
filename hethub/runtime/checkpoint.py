"""Checkpoints stored per *layer*, not per rank, so a checkpoint saved under plan A loads under plan B.

Layout of ``<dir>/<tag>/`` (DeepSpeed's layer-file naming where it helps interoperability):

    layer_03-model_states.pt   the layer's state_dict (DeepSpeed's pipeline files carry the same name stem)
    layer_03-optim_states.pt   per parameter name: the optimizer's state (momentum, Adam moments, step)
    meta.json                  model shape, step, samples consumed, optimizer hyper-parameters, plan summary,
                               tied weights (each stored once, with its first layer; ``hethub.models.ties``)

Saving (``hethub.runtime.saving``) is atomic: every writer (replica 0 of each stage: replicas hold identical
weights and optimizer state under ZeRO-0) writes into ``<dir>/.tmp-<tag>``; once all are done rank 0 flushes,
renames it to ``<dir>/<tag>`` and then replaces ``<dir>/latest`` (written to a temporary file and renamed). A crash
at any point leaves the previous checkpoint and ``latest`` intact. ``meta.json`` holds every layer file's sha256.

Loading treats the directory as untrusted data: tags (and what ``latest`` names) resolve only to folders directly
inside it, each file is checked against its digest before ``torch.load(..., weights_only=True)``, and meta.json is
validated; a missing or dangling ``latest`` falls back to the newest complete checkpoint and says so.
"""
from __future__ import annotations

import json
import os
import re
import sys
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from ..partitioner.errors import InputError, short
from ..partitioner.provenance import sha256_file
from .errors import fail
from .precision import load_scaler_state
from .tp import from_local, is_dtensor, local, shard_of

LATEST = "latest"


@dataclass(frozen=True)
class Counters:
    """The parts's step counters a checkpoint stores and a load restores."""
    global_steps: int
    global_samples: int
    skipped_steps: int = 0


@dataclass(frozen=True)
class CheckpointParts:
    """Everything a checkpoint reads and writes, named (the parts builds it, ``parts.checkpoint_parts``): the
    stage's layers, its optimizer (and ZeRO-1 shards), scheduler and loss scaler, the counters at the call, the
    plan and the rank's place in it, and the collectives a checkpoint needs (``control`` for verdicts, the
    stage's ``gradients`` for ZeRO-1's gathers). Saving and loading touch nothing else of the parts."""
    plan: Any
    grid: Any
    control: Any
    module: Any
    optimizer: Any
    counters: Counters
    zero1: Any = None
    lr_scheduler: Any = None
    loss_scaler: Any = None
    ties: Sequence = ()
    gradients: Any = None

    @property
    def rank(self) -> int:
        return self.grid.global_rank


def layer_file(d: str, idx: int, kind: str) -> str:
    return os.path.join(d, f"layer_{idx:02d}-{kind}_states.pt")


def param_names(parts: CheckpointParts) -> dict[int, tuple[int, str]]:
    """id(parameter) -> (layer index, parameter name inside the layer); a tied weight held by several local
    layers maps to the first of them."""
    out: dict[int, tuple[int, str]] = {}
    for idx, layer in parts.module.indexed_layers():
        for name, p in layer.named_parameters():
            out.setdefault(id(p), (idx, name))
    return out


def tie_owners(parts: CheckpointParts) -> dict[tuple[int, str], tuple[int, str]]:
    """(layer, name) of every tied place but the first -> the first (where the weight is stored)."""
    return {place: tie.owner for tie in parts.ties for place in tie.places[1:]}


def complete_checkpoints(save_dir: str) -> list[str]:
    """Tags of complete checkpoints (renamed into place, with a readable meta.json), oldest first by step; a
    folder that is not one (another format, a broken meta.json, a link out of the directory) is not listed."""
    if not os.path.isdir(save_dir):
        return []
    tags = []
    for name in os.listdir(save_dir):
        if _TAG.fullmatch(name) and os.path.isfile(os.path.join(save_dir, name, "meta.json")):
            try:
                tags.append((read_meta(os.path.join(save_dir, checked_tag(save_dir, name)))["global_steps"], name))
            except InputError:
                continue  # not a checkpoint this hethub can load: another candidate is
    return [t for _, t in sorted(tags)]


FORMAT_VERSION = 2  # 2: meta.json holds the sha256 of every layer file
_TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,199}")
_META_INTS = ("global_steps", "global_samples")


def checked_tag(root: str, tag: object, what: str = "tag") -> str:
    """A checkpoint name inside ``root``: a plain name (never a path, never ``..``) whose folder, links resolved,
    is directly inside ``root``. Why: a ``latest`` file or a tag comes from the directory, which may not be
    trusted; it must never lead the resume to files elsewhere."""
    if not isinstance(tag, str) or not _TAG.fullmatch(tag) or ".." in tag:
        raise InputError("checkpoint", f"{what} {short(tag)} is not a checkpoint name inside {root[:100]!r} "
                                       "(letters, digits, '.', '-' and '_'; never a path)")
    if os.path.dirname(os.path.realpath(os.path.join(root, tag))) != os.path.realpath(root):
        raise InputError("checkpoint", f"{what} {short(tag)} leads out of {root[:100]!r} (a link): refused")
    return tag


def read_meta(d: str) -> dict:
    """A checkpoint's meta.json, checked: one line naming what is wrong (not JSON, a field missing or of the
    wrong type, an older format without digests)."""
    path = os.path.join(d, "meta.json")
    try:
        with open(path, encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise InputError("checkpoint", f"{path[:160]} is not readable JSON ({type(exc).__name__})") from None
    if not isinstance(meta, dict):
        raise InputError("checkpoint", f"{path[:160]}: expected a JSON object, got {type(meta).__name__}")
    if meta.get("version") != FORMAT_VERSION:
        raise InputError("checkpoint", f"{path[:160]}: format version {short(meta.get('version'))}, this hethub "
                                       f"reads {FORMAT_VERSION} (per-file digests); save it again with this hethub")
    bad = [k for k in _META_INTS if not (isinstance(meta.get(k), int) and not isinstance(meta.get(k), bool)
                                         and meta[k] >= 0)]
    bad += [k for k, kind in (("model", dict), ("digests", dict)) if not isinstance(meta.get(k), kind)]
    if bad:
        raise InputError("checkpoint", f"{path[:160]}: {bad[0]} missing or of the wrong type "
                                       f"({short(meta.get(bad[0]))})")
    return meta


def _state_for(p: torch.Tensor, v: Any, flat: bool) -> Any:
    """A whole optimizer state tensor from a file laid out for parameter ``p``: this rank's shard of it, as a
    DTensor like ``p`` (or a plain shard for ZeRO-1's flat state, ``flat``)."""
    if not (torch.is_tensor(v) and v.dim() > 0):
        return v
    part = shard_of(v, p).to(local(p).device)
    if is_dtensor(p) and not flat:
        return from_local(part.contiguous(), p)
    return part


def _load_layer(layer: torch.nn.Module, state: dict) -> None:
    """``load_state_dict`` that also fills tensor-parallel (DTensor) parameters with their shard of a whole
    tensor; shapes and keys were checked before."""
    with torch.no_grad():
        for k, target in layer.state_dict(keep_vars=True).items():
            mine = local(target)
            mine.copy_(shard_of(state[k], target).to(mine.device, mine.dtype))


def resolve_tag(load_dir: str, tag: Optional[str], say=print) -> str:
    if tag is not None:
        checked_tag(load_dir, tag)
        if not os.path.isfile(os.path.join(load_dir, tag, "meta.json")):
            raise InputError("checkpoint", f"{os.path.join(load_dir, tag)} is not a complete checkpoint")
        return tag
    latest = os.path.join(load_dir, LATEST)
    if os.path.isfile(latest):
        try:
            with open(latest, encoding="utf-8") as f:
                t = f.read(256).strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise InputError("checkpoint", f"cannot read {latest[:160]} ({type(exc).__name__})") from None
        checked_tag(load_dir, t, f"{latest[:160]} names")
        if os.path.isfile(os.path.join(load_dir, t, "meta.json")):
            return t
        reason = f"{latest} names {t!r}, which is not a complete checkpoint"
    else:
        reason = f"no {latest}"
    tags = complete_checkpoints(load_dir)
    if not tags:
        raise InputError("checkpoint", f"no complete checkpoint in {load_dir!r} ({reason})")
    say(f"hethub: {reason}; loading the newest complete checkpoint {tags[-1]!r}")
    return tags[-1]


def load_layer_file(path: str, digests: dict) -> Any:
    """A layer file, checked against the digest meta.json holds for it, loaded as data (``weights_only``)."""
    name = os.path.basename(path)
    if not os.path.isfile(path):
        raise InputError("checkpoint", f"missing file {path}")
    if name not in digests:
        raise InputError("checkpoint", f"{path[:160]} has no digest in meta.json: refused")
    if sha256_file(path) != digests[name]:
        raise InputError("checkpoint", f"{path[:160]} does not match the digest saved with it (changed or "
                                       "corrupt): refused")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise InputError("checkpoint", f"missing file {path}") from None
    except Exception as exc:  # noqa: BLE001 - truncated/corrupt files raise many types
        raise InputError("checkpoint", f"{path} is truncated or corrupt ({type(exc).__name__})") from None


def load(parts: CheckpointParts, load_dir: str, tag: Optional[str] = None,
         load_optimizer_states: bool = True) -> tuple[str, dict, Counters]:
    """Collective. Load whatever layers this rank's stage holds under the *current* plan; returns (tag,
    client_state, the counters the checkpoint was taken at) for the parts to take.

    Every rank checks its own files first; an all-reduce of the verdict then ends every rank with
    exit 2 when any rank found a problem (its own message, or which rank failed), so none hangs.
    """
    error = None
    try:
        result = _load_local(parts, load_dir, tag, load_optimizer_states)
    except InputError as exc:
        error, result = str(exc), None
    agree(parts, error, "could not load its layers")
    steps = result[2].global_steps if result is not None else 0
    # Hosts that do not share the directory can each hold a complete checkpoint of another step
    # one MIN over (step, -step): the lowest and the highest step (from each rank's meta.json) at once
    low, neg_high = parts.control.min([steps, -steps])
    high = -neg_high
    if low != high:
        fail(f"checkpoint: ranks found checkpoints of different steps ({low} to {high}) in "
             f"{load_dir[:100]!r}: it is not shared by every host; load from a filesystem every host mounts")
    return result


def agree(parts: CheckpointParts, error: Optional[str], what: str) -> None:
    """Collective: every rank gives its own verdict (None: fine); when any rank failed, every rank ends with
    exit 2, the failed rank with its message, the others naming it, so none is left waiting in a collective."""
    failed = parts.control.min([parts.rank if error else parts.plan.world_size])[0]
    if failed < parts.plan.world_size:
        fail(error or f"checkpoint: rank {failed} {what} (see its message)")


def _load_optimizer_state(parts: CheckpointParts, names: dict, by_layer: dict) -> None:
    """Per-parameter state from the files into the optimizer: as is, or joined into this replica's flat
    ZeRO-1 shards (a group whose parameters have no state yet, e.g. saved before any step, is left empty)."""
    opt = parts.optimizer

    def saved(p):
        idx, name = names[id(p)]
        return by_layer.get(idx, {}).get(name)

    if parts.zero1 is not None:
        for shard in parts.zero1.shards:
            states = [saved(p) for p in shard.params]
            if states and all(st is not None for st in states):
                # (a stage mixing degrees shards the whole tensors: the files' as they are)
                mine = states if shard.whole else [{k: _state_for(p, v, flat=True) for k, v in st.items()}
                                                   for p, st in zip(shard.params, states)]
                opt.state[shard.shard] = shard.join_state(mine)
        return
    for group in opt.param_groups:
        for p in group["params"]:
            st = saved(p) if id(p) in names else None
            if st is not None:
                opt.state[p] = {k: _state_for(p, v, flat=False) for k, v in st.items()}


def _load_local(parts: CheckpointParts, load_dir: str, tag: Optional[str],
                load_optimizer_states: bool) -> tuple[str, dict, Counters]:
    say = (lambda m: print(m, file=sys.stderr, flush=True)) if parts.rank == 0 else (lambda m: None)
    tag = resolve_tag(load_dir, tag, say)
    d = os.path.join(load_dir, tag)
    meta = read_meta(d)
    digests = meta["digests"]
    names = param_names(parts)
    owners = tie_owners(parts)
    states: dict[int, dict] = {}
    for idx, layer in parts.module.indexed_layers():
        state = load_layer_file(layer_file(d, idx, "model"), digests)
        for k, v in layer.state_dict().items():
            if k not in state and (idx, k) in owners:  # a tied weight: stored once, with its first layer
                o_idx, o_name = owners[(idx, k)]
                owner_state = load_layer_file(layer_file(d, o_idx, "model"), digests)
                if o_name in owner_state:
                    state[k] = owner_state[o_name]
            if k not in state:
                raise InputError("checkpoint", f"layer {idx} ({type(layer).__name__}): {k} missing in "
                                               f"{layer_file(d, idx, 'model')}")
            if tuple(state[k].shape) != tuple(v.shape):
                raise InputError("checkpoint", f"layer {idx} ({type(layer).__name__}).{k}: checkpoint shape "
                                               f"{tuple(state[k].shape)}, model shape {tuple(v.shape)} "
                                               f"(checkpoint of model {meta['model'].get('name')!r})")
        states[idx] = state
    saved, mine = meta["model"], parts.plan.model.model_dump()
    for key in ("architecture", "num_layers"):
        if saved.get(key) != mine.get(key):
            raise InputError("checkpoint", f"{d} holds model {saved.get('name')!r} with {key}={saved.get(key)}, "
                                           f"the plan's model {mine.get('name')!r} has {key}={mine.get(key)}")
    wanted = set(states) | {owners[(i, n)][0] for i, n in names.values() if (i, n) in owners}
    by_layer = ({idx: load_layer_file(layer_file(d, idx, "optim"), digests) for idx in wanted}
                if load_optimizer_states else {})
    for place, (o_idx, o_name) in owners.items():  # a tied weight's state, from its first layer
        st = by_layer.get(o_idx, {}).get(o_name)
        if st is not None and place[0] in by_layer:
            by_layer[place[0]].setdefault(place[1], st)
    for idx, layer in parts.module.indexed_layers():
        _load_layer(layer, states[idx])
    if load_optimizer_states:
        _load_optimizer_state(parts, names, by_layer)
        if parts.lr_scheduler is not None and meta.get("lr_scheduler"):
            parts.lr_scheduler.load_state_dict(meta["lr_scheduler"])
        load_scaler_state(parts.loss_scaler, meta.get("loss_scaler"), d)
    skipped = meta.get("skipped_steps", 0)
    counters = Counters(meta["global_steps"], meta["global_samples"],
                        skipped if isinstance(skipped, int) and not isinstance(skipped, bool) else 0)
    return tag, meta.get("client_state", {}), counters
