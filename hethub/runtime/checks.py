"""Everything about a launch that must hold before the first collective: the config's ``"hetero"`` section, the
plan, the plan against the launched world, the layer list and the config's batch keys, a hand-edited schedule.

Why apart from start-up: each check is pure (no process group), so every rank reaches the same verdict from the
same input and ends with the same one line and exit 2, before any rank can wait on another.
"""
from __future__ import annotations

import json
import os
from typing import Any, Optional, Sequence, Union

import torch
from pydantic import Field, field_validator

from ..emulated.slowdown import MAX_SLOWDOWN
from ..partitioner.costmodel import DEFAULT_BUCKET_MB, cost_model_for
from ..partitioner.errors import InputError
from ..partitioner.records import Plan, Record, load_plan, parse_record, read_data_file
from ..partitioner.schedule import read_schedule_file
from ..partitioner.simulator import simulate

DEFAULT_TIMEOUT_S = 300


def load_config(config: Union[dict, str, None]) -> dict:
    if config is None:
        return {}
    if isinstance(config, dict):
        return json.loads(json.dumps(config))  # deep copy; we fill in batch keys
    data = read_data_file(str(config), "config")  # JSON (YAML also accepted)
    if not isinstance(data, dict):
        raise InputError("config", f"{config}: expected a JSON object, got {type(data).__name__}")
    return data


MIN_TIMEOUT_S, MAX_TIMEOUT_S = 1.0, 7 * 86400  # under a second no start-up finishes; past a week it is a typo
MIN_BUCKET_MB, MAX_BUCKET_MB = 1e-3, 65536.0  # 1 KiB (tests, tiny models) .. 64 GiB (one bucket for anything)


class HeteroSection(Record):
    """ds_config's ``"hetero"`` section, checked whole on every rank before any collective.

    Why: a misspelt key (``"timout_s"``) would otherwise be a setting silently ignored, and a bad value a
    traceback halfway through start-up; here either is one line naming ``config.hetero.<field>``.
    """
    plan: Optional[Union[str, dict]] = None  # plan.json, or the plan itself (overridden by plan= and --hetero-plan)
    schedule: Optional[str] = None  # a hand-edited schedule file (``hethub simulate --print-schedule``'s format)
    resume: Optional[str] = None  # load the newest complete checkpoint in this directory at initialize
    emulate_slowdown: Optional[dict[str, float]] = None  # {device type: k}: emulated heterogeneity (hethub.emulated.slowdown)
    timeout_s: float = Field(DEFAULT_TIMEOUT_S, ge=MIN_TIMEOUT_S, le=MAX_TIMEOUT_S)  # torch.distributed's, for every collective
    # the data-parallel gradient all-reduce's bucket size (hethub.runtime.buckets; the cost model's default)
    bucket_mb: float = Field(DEFAULT_BUCKET_MB, ge=MIN_BUCKET_MB, le=MAX_BUCKET_MB)

    @field_validator("emulate_slowdown")
    @classmethod
    def _slowdowns(cls, value: Optional[dict[str, float]]) -> Optional[dict[str, float]]:
        for name, k in (value or {}).items():
            if not 1.0 <= k <= MAX_SLOWDOWN:
                raise ValueError(f"{name}: must be in [1, {MAX_SLOWDOWN:g}], got {k!r}")
        return value


def hetero_section(config: dict) -> HeteroSection:
    """The checked ``"hetero"`` section of a ds_config dict (an absent section is all defaults)."""
    section = config.get("hetero")
    if section is None:
        section = {}
    if not isinstance(section, dict):
        raise InputError("config.hetero", f"expected an object of hethub's settings, got {type(section).__name__}")
    return parse_record(HeteroSection, section, "config.hetero")


def resolve_plan(plan: Union[Plan, str, None], section: HeteroSection, args: Any = None) -> Plan:
    """The plan argument wins over ``--hetero-plan``, which wins over ``config['hetero']['plan']``."""
    if plan is None and args is not None:
        plan = getattr(args, "hetero_plan", None)
    if plan is None:
        plan = section.plan
    if plan is None:
        raise InputError("plan", "no plan given: pass plan=..., --hetero-plan, or ds_config['hetero']['plan']")
    if isinstance(plan, Plan):
        return plan
    if isinstance(plan, dict):
        return parse_record(Plan, plan, "plan")
    return load_plan(str(plan))


def launched_world() -> tuple[int, int]:
    """(rank, world size) of this process, from torch.distributed or the launcher's environment."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    try:
        return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        raise InputError("env", f"RANK/WORLD_SIZE must be integers, got RANK={os.environ.get('RANK')!r} "
                                f"WORLD_SIZE={os.environ.get('WORLD_SIZE')!r}") from None


def on_gpu() -> bool:
    """Whether this run trains on the GPUs (a GPU machine may still run the CPU accelerator: the demo does)."""
    return torch.cuda.is_available() and os.environ.get("DS_ACCELERATOR", "") != "cpu"


def detected_device_type(index: int) -> Optional[str]:
    """The name of the accelerator this rank runs on (device ``index`` of the visible ones; None on CPU).
    HETHUB_DEVICE_TYPE overrides."""
    if os.environ.get("HETHUB_DEVICE_TYPE"):
        return os.environ["HETHUB_DEVICE_TYPE"]
    if on_gpu():
        return torch.cuda.get_device_name(index)
    return None


def local_device_index(plan: Plan, rank: int) -> int:
    """This rank's device among its host's visible ones: its slot's position among the plan's slots on the host
    (``hethub launch --local`` runs every rank on one machine: there it is the rank)."""
    return rank if os.environ.get("HETHUB_LOCAL") == "1" else plan_local_index(plan, rank)


def _type_matches(plan_type: str, detected: str) -> bool:
    """'A100-80GB' matches 'NVIDIA A100-SXM4-80GB': every token of the plan's name appears in the device's."""
    d = detected.upper().replace(" ", "-")
    return plan_type.upper() == d or all(tok in d for tok in plan_type.upper().split("-"))


def _ranks_of(stage) -> str:
    return str(stage.width) if stage.tensor_parallel == 1 else f"{stage.width}x{stage.tensor_parallel}"


def check_against_world(plan: Plan, rank: int, world: int, layers: Sequence[Any], config: dict,
                        optimizer: Any = None) -> None:
    """Everything about plan vs launch vs model that must hold before any collective."""
    if world != plan.world_size:
        raise InputError("plan", f"plan needs world size {plan.world_size} "
                                 f"({' + '.join(_ranks_of(s) for s in plan.stages)} ranks), launched with {world}")
    stage_id, rep = plan.locate(rank)
    stage = plan.stages[stage_id]
    mine = stage.type_of(stage.replicas[rep])
    local = local_device_index(plan, rank)
    if on_gpu() and local >= torch.cuda.device_count():
        raise InputError(f"plan.stages[{stage_id}].replicas", f"rank {rank} runs on device {local} of host "
                                                              f"{stage.replicas[rep].host}, but it sees "
                                                              f"{torch.cuda.device_count()} (CUDA_VISIBLE_DEVICES="
                                                              f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})")
    detected = detected_device_type(local)
    if detected is not None and not _type_matches(mine, detected):
        raise InputError(f"plan.stages[{stage_id}].device_type", f"rank {rank} runs on {detected!r}, but the plan "
                                                                 f"puts a {mine} there")
    n = plan.model.num_planner_layers
    if len(layers) != n:
        raise InputError("layers", f"the plan's model {plan.model.name!r} has {n} planner layers "
                                   f"(embedding, {plan.model.num_layers} blocks, head), got a list of {len(layers)}")
    samples = stage.replicas[rep].samples
    expected = {"train_batch_size": plan.global_batch_size, "gradient_accumulation_steps": plan.num_micro_batches,
                "train_micro_batch_size_per_gpu": samples}
    for key, want in expected.items():
        if key in config and config[key] != want:
            raise InputError(f"config.{key}", f"must agree with the plan ({want} on rank {rank}), got {config[key]}")
    zero = (config.get("zero_optimization") or {}).get("stage", 0)
    if zero not in (0, 1):
        raise InputError("config.zero_optimization.stage", f"hethub runs ZeRO stage 0 or 1 (stage 1 shards optimizer "
                                                           f"state over each stage's replicas); stages 2 and 3 are "
                                                           f"not supported, got {zero!r}")
    if plan.zero1 and zero != 1:
        raise InputError("config.zero_optimization.stage", "the plan was made with --zero1 (its memory assumes "
                                                           "optimizer state sharded over each stage's replicas): set "
                                                           "\"zero_optimization\": {\"stage\": 1}")
    if stage.tensor_parallel > 1 and optimizer is not None and hasattr(optimizer, "step"):
        raise InputError("optimizer", "with tensor parallelism pass a callable params -> Optimizer: hethub splits "
                                      "the layers' parameters first, so an optimizer built before holds the old ones")


def load_checked_schedule(plan: Plan, path: str, rank: int) -> list:
    """A hand-edited schedule file (``hetero.schedule``), checked before any collective: every rank's list
    present, transfers matched, structure sound, and a dry run that finishes (a deadlock names rank and step)."""
    sched = read_schedule_file(str(path))
    simulate(plan, cost_model_for(plan), sched)
    return sched[rank]


def plan_local_index(plan: Plan, rank: int) -> int:
    """Index of this rank's slot among the plan's slots on its host (= its device among the visible ones)."""
    stage, rep = plan.locate(rank)
    st = plan.stages[stage]
    me = st.replicas[rep]
    mine = dict(zip(me.group_ranks(st.tensor_parallel), me.group_slots(st.tensor_parallel)))[rank]
    slots = sorted(slot for s in plan.stages for r in s.replicas if r.host == me.host
                   for slot in r.group_slots(s.tensor_parallel))
    return slots.index(mine)
