"""Tied weights across pipeline layers (GPT-2's embedding and LM head): DeepSpeed's ``TiedLayerSpec``
semantics under any widths.

Why by identity: a ``transformers`` model ties by making two modules hold one ``Parameter``, and a user's
layer list does the same; so a tie is a Parameter reached from two or more planner layers of the list
given to ``hethub.initialize`` (every rank builds that list, so every rank finds the same ties before any
collective). ``TiedLayerSpec`` entries are built once per key and the module shared, which reduces them to
the same case.

When a tie's layers sit on different stages, each of those stages holds the weight and computes a partial
gradient. After each stage's own all-reduce, replica 0 of each stage contributes its stage's sum and the
other replicas zeros to an all-reduce over every replica of those stages, so every holder ends with the
one gradient a single process would accumulate, and the same update keeps the copies identical. The global
norm counts the weight once (on its first stage); checkpoints store it once, with its first layer.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Collection, Optional, Sequence

from torch import nn


@dataclass(frozen=True)
class Tie:
    """One Parameter reached from several planner layers: (layer index, name inside that layer) of each,
    in layer order. The first place owns it in checkpoints and in the gradient norm."""

    places: tuple[tuple[int, str], ...]

    @property
    def owner(self) -> tuple[int, str]:
        return self.places[0]


class _TiedForward(nn.Module):
    """A ``TiedLayerSpec`` occurrence with its own ``forward_fn(module, x)`` over the shared module."""

    def __init__(self, module: nn.Module, fn):
        super().__init__()
        self.module, self.fn = module, fn

    def forward(self, x):
        return self.fn(self.module, x)


def resolve_tied_specs(layers: Sequence[Any], mine: Optional[Collection[int]] = None) -> list[Any]:
    """``TiedLayerSpec`` entries built once per key and shared (whole module); with ``mine`` (the layer indices this
    rank runs) its ``LayerSpec``s built too. Every spec is then built in list order, the other ranks' dropped at
    once (their entries stay specs): the random state advances as when one process builds the whole model, so
    every layer's initial weights are the one-process weights whatever the plan (DeepSpeed's ``PipelineModule``
    builds its specs in order the same way). Without ``mine`` other entries are left as they are."""
    built: dict[Any, nn.Module] = {}
    out = []
    for idx, spec in enumerate(layers):
        if type(spec).__name__ == "TiedLayerSpec":
            module = built.get(spec.key)
            if module is None:
                module = built[spec.key] = spec.build()
            fn = getattr(spec, "forward_fn", None)
            out.append(_TiedForward(module, fn) if fn is not None else module)
        elif mine is not None and hasattr(spec, "build") and not isinstance(spec, nn.Module):
            layer = spec.build()  # another rank's layer: built only for its draws from the random state
            out.append(layer if idx in mine else spec)
        else:
            out.append(spec)
    return out


def find_ties(layers: Sequence[Any]) -> list[Tie]:
    """Every Parameter reached from two or more layers of the list (modules only; lazy LayerSpecs have none yet)."""
    places: dict[int, list[tuple[int, str]]] = {}
    for idx, layer in enumerate(layers):
        if isinstance(layer, nn.Module):
            for name, p in layer.named_parameters():
                places.setdefault(id(p), []).append((idx, name))
    return sorted((Tie(tuple(ps)) for ps in places.values() if len({i for i, _ in ps}) > 1),
                  key=lambda t: t.places)


def stages_of(tie: Tie, layer_stage: Sequence[int]) -> list[int]:
    """Stages holding the tie's layers, ascending (``layer_stage[i]``: the stage of planner layer i)."""
    return sorted({layer_stage[i] for i, _ in tie.places})
