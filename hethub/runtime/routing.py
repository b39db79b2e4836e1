"""A DeepSpeed script, unchanged, under a hethub plan: ``deepspeed.initialize`` returns hethub's engine.

Why here and how: DeepSpeed picks its engine class inside ``deepspeed.initialize`` and has no plugin hook, so
where a plan is in force (``hethub launch --hetero-plan P`` exports it as ``HETHUB_PLAN`` and starts each rank
through ``hethub.cli.rank_entry``; or a script that imported hethub passes a ds_config with a ``hetero``
section) hethub replaces, once, before the script runs:

- ``deepspeed.initialize`` -> ``hethub.initialize`` with the same keywords (``model=`` a ``PipelineModule``,
  ``model_parameters=``, ``training_data=``, ``config=``, ``args=``, ``lr_scheduler=``, ``collate_fn=``);
- ``deepspeed.init_distributed`` -> hethub's world start (gloo without a device binding where the plan spans
  vendors), once the plan is known;
- ``PipelineModule.__init__`` -> no topology and only this rank's layers: the script builds
  ``PipelineModule(num_stages=S)`` before ``initialize``, whose constructor makes a topology from the world size
  (a world S does not divide fails there) and builds its own stage's layers; under a plan the layers are the
  plan's to place;
- ``DeepSpeedEngine.__init__`` -> refused (one line, exit 2) for any engine but hethub's while a plan is in
  force: **never a silent plain-DeepSpeed run**.

Without a plan every call goes to DeepSpeed unchanged.
"""
from __future__ import annotations

import difflib
import inspect
import os
import sys
from typing import Any, Optional

import deepspeed
import torch.nn as nn
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.pipe.module import LayerSpec, PipelineModule

from ..dsconfig import DEFAULT_TIMEOUT_S, HeteroSection, load_config
from ..models.ties import resolve_tied_specs
from ..partitioner.errors import InputError, print_error
from .checks import resolve_plan
from .engine import HeteroPipelineEngine
from .errors import fail
from .capture import capturing
from .startup import init_distributed, initialize

PLAN_ENV = "HETHUB_PLAN"  # the plan file hethub launch hands every rank
_STATE: dict[str, Any] = {"installed": False, "engine_built": False, "original": {}}


def plan_in_force() -> Optional[str]:
    """The plan ``hethub launch`` handed this rank, if any."""
    return os.environ.get(PLAN_ENV) or None


def _read_config(config: Any) -> dict:
    """The ds_config (a dict or a JSON/YAML file) as a dict; {} where there is none or DeepSpeed will report it."""
    if config is None:
        return {}
    try:
        cfg = load_config(config)
    except Exception:  # noqa: BLE001 - DeepSpeed reads it next and reports its own error
        return {}
    return cfg if isinstance(cfg, dict) else {}


def _config_of(args: Any, config: Any) -> Any:
    return config if config is not None else getattr(args, "deepspeed_config", None)


def routed_initialize(args=None, model=None, optimizer=None, model_parameters=None, training_data=None,
                      lr_scheduler=None, distributed_port=None, mpu=None, dist_init_required=None,
                      collate_fn=None, config=None, config_params=None, **kwargs):
    """``deepspeed.initialize``'s signature: hethub's engine where a plan is in force, DeepSpeed's otherwise."""
    config = config if config is not None else config_params
    cfg = _read_config(_config_of(args, config))
    _refuse_near_miss(cfg)
    if plan_in_force() is None and cfg.get("hetero") is None and not capturing():
        return _STATE["original"]["initialize"](
            args=args, model=model, optimizer=optimizer, model_parameters=model_parameters,
            training_data=training_data, lr_scheduler=lr_scheduler, distributed_port=distributed_port, mpu=mpu,
            dist_init_required=dist_init_required, collate_fn=collate_fn, config=config, **kwargs)
    if mpu is not None:
        _refuse("initialize", "mpu: a plan places every rank (hethub's grid replaces the model-parallel unit); "
                              "drop mpu= under --hetero-plan")
    return initialize(model=model, config=config, optimizer=optimizer, model_parameters=model_parameters,
                      lr_scheduler=lr_scheduler, args=args, training_data=training_data, collate_fn=collate_fn)


def _refuse_near_miss(cfg: dict) -> None:
    """A top-level ds_config key one typo away from ``hetero`` (DeepSpeed ignores unknown keys: the run would be
    plain DeepSpeed, in silence)."""
    for key in cfg:
        if key != "hetero" and difflib.get_close_matches(str(key), ["hetero"], n=1, cutoff=0.75):
            _refuse(f"config.{str(key)[:40]}", "not a DeepSpeed key; did you mean \"hetero\" (hethub's section)? "
                                               "As written, DeepSpeed would ignore it and train without the plan")


def routed_init_distributed(*args, **kwargs):
    """Under a plan the world is hethub's (``startup.init_distributed``: its backend and device binding follow
    the plan); DeepSpeed's own otherwise."""
    if capturing():  # hethub profile --script: one process measures, no world
        return None
    plan_path = plan_in_force()
    if plan_path is None:
        return _STATE["original"]["init_distributed"](*args, **kwargs)
    try:
        plan = resolve_plan(plan_path, HeteroSection())
    except InputError as exc:
        fail(str(exc))
    timeout = kwargs.get("timeout")
    init_distributed(timeout.total_seconds() if timeout is not None else DEFAULT_TIMEOUT_S, plan)


def _deferred_pipeline_init(self, *args, **kwargs):
    """``PipelineModule(...)`` under a plan: no topology made (a world its ``num_stages`` does not divide would
    fail there) and only the layers the plan gives this rank kept (``hethub.initialize(model=...)`` reads them).

    Its specs are built as DeepSpeed's constructor builds them on one process, in the same order, so that every
    layer starts from the weights one process would give it: with ``partition_method="parameters"`` (the default)
    DeepSpeed builds every ``LayerSpec`` once to count its parameters, then each again for its stage; here the
    other ranks' layers are built and dropped at once (``resolve_tied_specs``)."""
    bound = inspect.signature(_STATE["original"]["PipelineModule.__init__"]).bind(self, *args, **kwargs)
    bound.apply_defaults()
    given = dict(bound.arguments)
    given.pop("self")
    nn.Module.__init__(self)
    specs = list(given["layers"])
    if str(given["partition_method"]).lower() == "parameters":
        for spec in specs:
            if isinstance(spec, LayerSpec):
                spec.build()  # DeepSpeed's parameter count: only its draws from the random state matter
    mine = set(range(len(specs))) if capturing() else _planned_layers()  # profile --script: every layer
    self._layer_specs = resolve_tied_specs(specs, mine)
    # this rank's layers, as submodules: net.parameters() is this stage's (an optimizer the script builds over
    # them, or model_parameters=, holds the very tensors hethub's engine trains)
    local = {id(m): m for i, m in enumerate(self._layer_specs) if mine and i in mine and isinstance(m, nn.Module)}
    self.hethub_layers = nn.ModuleList(local.values())
    self.loss_fn = given["loss_fn"]
    self.hethub_deferred = given  # num_stages, partition_method, activation_checkpoint_interval, ...
    self.hethub_built = mine is not None  # this rank's layers are built: initialize builds nothing again


def _planned_layers() -> Optional[set]:
    """The layers the plan in force gives this rank."""
    try:
        plan = resolve_plan(plan_in_force(), HeteroSection())
    except InputError as exc:
        fail(str(exc))
    return plan.rank_layers(int(os.environ.get("RANK", "0")))


def _guarded_engine_init(self, *args, **kwargs):
    """A DeepSpeed engine other than hethub's while a plan is in force is a silent plain-DeepSpeed run: refused."""
    if not isinstance(self, HeteroPipelineEngine) and plan_in_force():
        _refuse("--hetero-plan", f"the script built DeepSpeed's own {type(self).__name__} while a hethub plan is in "
                                 "force (it would train with DeepSpeed's partition, not the plan's): build the "
                                 "engine with deepspeed.initialize(...) or hethub.initialize(...)")
    _STATE["engine_built"] = True
    return _STATE["original"]["DeepSpeedEngine.__init__"](self, *args, **kwargs)


def _refuse(field: str, why: str) -> None:
    fail(f"{field}: {why}")


def install() -> None:
    """Route DeepSpeed's entry points through hethub (idempotent)."""
    if _STATE["installed"]:
        return
    original = _STATE["original"]
    original["initialize"], original["init_distributed"] = deepspeed.initialize, deepspeed.init_distributed
    original["PipelineModule.__init__"] = PipelineModule.__init__
    original["DeepSpeedEngine.__init__"] = DeepSpeedEngine.__init__
    for replacement, replaced in ((routed_initialize, original["initialize"]),
                                  (routed_init_distributed, original["init_distributed"]),
                                  (_deferred_pipeline_init, original["PipelineModule.__init__"]),
                                  (_guarded_engine_init, original["DeepSpeedEngine.__init__"])):
        replacement.__wrapped__ = replaced  # inspect.unwrap finds DeepSpeed's own (ds_seams reads its source)
    deepspeed.initialize = routed_initialize
    deepspeed.init_distributed = routed_init_distributed
    if plan_in_force() is not None or capturing():
        PipelineModule.__init__ = _deferred_pipeline_init
    DeepSpeedEngine.__init__ = _guarded_engine_init
    _STATE["installed"] = True


def engine_built() -> bool:
    return _STATE["engine_built"]


def check_ended_under_plan() -> None:
    """At the end of a script ``hethub launch`` ran under a plan: it must have built hethub's engine."""
    if plan_in_force() is not None and not _STATE["engine_built"]:
        print_error("--hetero-plan: the script ended without building a DeepSpeed engine (deepspeed.initialize or "
                    "hethub.initialize): nothing trained under the plan")
        sys.stdout.flush()
        os._exit(2)
