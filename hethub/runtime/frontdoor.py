"""DeepSpeed's ``initialize`` keywords, read as hethub's: ``model=`` (a ``PipelineModule``, an ``nn.Sequential`` or
a list of layers), ``training_data=`` and ``collate_fn=``.

Why a module of its own: a DeepSpeed pipeline script describes its model as a ``PipelineModule`` (``LayerSpec``s,
``TiedLayerSpec``s, its ``loss_fn``) and hands DeepSpeed a dataset; hethub's engine takes a layer list and a data
iterator. This is the translation, in one place, so that the same script runs under either.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch.nn as nn
from deepspeed.runtime.dataloader import RepeatingLoader
from deepspeed.runtime.pipe.module import PipelineModule
from torch.utils.data import DataLoader, DistributedSampler

from .errors import fail


def model_layers(layers: Any, model: Any, loss_fn: Optional[Callable]) -> tuple[list, Optional[Callable], str, bool]:
    """(the layer list, the loss function, a note for rank 0 or "", whether this rank's layers are built already:
    a ``PipelineModule`` made under a plan, ``routing``) from hethub's ``layers=`` or DeepSpeed's
    ``model=``. A ``PipelineModule`` gives its layer specs (``LayerSpec``s are built only on the rank the plan
    puts them on; ``TiedLayerSpec``s become hethub ties) and its ``loss_fn``; its own ``num_stages`` and
    ``partition_method`` are the plan's to replace."""
    if (layers is None) == (model is None):
        fail("initialize: give the model once: layers=[...] (hethub) or model=PipelineModule(...) / "
             "nn.Sequential / a list (DeepSpeed's keyword)" + (", not both" if layers is not None else ""))
    if layers is not None:
        return list(layers), loss_fn, "", False
    if isinstance(model, PipelineModule):
        given = getattr(model, "hethub_deferred", None) or {}
        stages = given.get("num_stages", getattr(model, "num_stages", None))
        how = given.get("partition_method", getattr(model, "partition_method", None))
        note = (f"hethub: PipelineModule(num_stages={stages}, partition_method={how!r}) runs under the plan's stages "
                f"and widths instead")
        if given.get("activation_checkpoint_interval") or getattr(model, "activation_checkpoint_interval", 0):
            note += "; its activation_checkpoint_interval is replaced by the plan's recompute stages"
        return (list(model._layer_specs), loss_fn if loss_fn is not None else model.loss_fn, note,
                getattr(model, "hethub_built", False))
    if isinstance(model, nn.Sequential):
        return list(model), loss_fn, "", False
    if isinstance(model, (list, tuple)):
        return list(model), loss_fn, "", False
    fail(f"model: expected a deepspeed.pipe.PipelineModule, an nn.Sequential or a list of layers, got "
         f"{type(model).__name__} (a hethub plan cuts the model into stages between its layers)")


def training_loader(training_data: Any, micro_batch_size: int, collate_fn: Optional[Callable]) -> DataLoader:
    """Whole micro-batches of ``training_data`` in the order one DeepSpeed pipeline process reads them (its
    engine's ``DistributedSampler`` over one replica, not shuffled: the dataset's order, again on every pass of
    the ``RepeatingLoader``); each rank keeps the rows of each micro-batch the plan gives it. A last partial
    micro-batch of a pass is dropped (a plan's micro-batch is whole)."""
    if not hasattr(training_data, "__len__") or not hasattr(training_data, "__getitem__"):
        fail(f"training_data: expected a map-style dataset (__len__ and __getitem__), got "
             f"{type(training_data).__name__}")
    if len(training_data) < micro_batch_size:
        fail(f"training_data: {len(training_data)} samples, fewer than the plan's micro-batch of {micro_batch_size}")
    sampler = DistributedSampler(training_data, num_replicas=1, rank=0, shuffle=False)
    return DataLoader(training_data, batch_size=micro_batch_size, sampler=sampler, collate_fn=collate_fn,
                      drop_last=True)


def attach_training_data(engine, training_data: Any, collate_fn: Optional[Callable]) -> Optional[DataLoader]:
    """``training_data`` as the engine's data (``train_batch()`` without an iterator reads it), on the ranks that
    load micro-batches; the loader (DeepSpeed's third return value), or None where none was given."""
    if training_data is None:
        return None
    loader = training_loader(training_data, engine.plan.micro_batch_size, collate_fn)
    engine.set_dataiterator(iter(RepeatingLoader(loader)))
    engine.training_dataloader = loader
    return loader
