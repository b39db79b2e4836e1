"""Everything about a launch that must hold before the first collective: the config's ``"hetero"`` section, the
plan, the plan against the launched world, the layer list and the config's batch keys, a hand-edited schedule.

Why apart from start-up: each check is pure (no process group), so every rank reaches the same verdict from the
same input and ends with the same one line and exit 2, before any rank can wait on another.
"""
from __future__ import annotations

import os
from typing import Any, Optional, Sequence, Union

import torch

from ..dsconfig import HeteroSection, check_batch_keys, check_zero
from ..partitioner.costmodel import cost_model_for
from ..partitioner.errors import InputError
from ..partitioner.records import Plan, load_plan, parse_record
from ..partitioner.schedule import read_schedule_file
from ..partitioner.simulator import simulate


def resolve_plan(plan: Union[Plan, str, None], section: HeteroSection, args: Any = None) -> Plan:
    """The plan: the ``plan`` argument (it overrides the others); else ``--hetero-plan`` (the script's argument, or
    what ``hethub launch`` exported as ``HETHUB_PLAN``) and ``config['hetero']['plan']``, which must be the same
    plan where both are given (one would otherwise win in silence)."""
    if plan is not None:
        return _read_plan(plan)
    launched = getattr(args, "hetero_plan", None) if args is not None else None
    launched = launched or os.environ.get("HETHUB_PLAN") or None
    if launched is None and section.plan is None:
        raise InputError("plan", "no plan given: pass plan=..., --hetero-plan, or ds_config['hetero']['plan']")
    found = [_read_plan(p) for p in (launched, section.plan) if p is not None]
    if len(found) == 2 and found[0].to_json() != found[1].to_json():
        raise InputError("plan", f"--hetero-plan {str(launched)[:100]!r} and the ds_config's hetero.plan "
                                 f"{str(section.plan)[:100]!r} are different plans: give one, or the same file")
    return found[0]


def _read_plan(plan: Union[Plan, dict, str]) -> Plan:
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
    if stage.uniform_tp:
        return str(stage.width) if stage.tensor_parallel == 1 else f"{stage.width}x{stage.tensor_parallel}"
    return "(" + "+".join(map(str, stage.degrees)) + ")"


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
    check_batch_keys(plan, config, [rank])
    check_zero(plan, config)
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
    mine = dict(zip(st.ranks_of(me), st.slots_of(me)))[rank]
    slots = sorted(slot for s in plan.stages for r in s.replicas if r.host == me.host for slot in s.slots_of(r))
    return slots.index(mine)


def connections_note(accelerator_groups: int, on_device: bool, env: Optional[dict] = None) -> Optional[str]:
    """A warning where ``CUDA_DEVICE_MAX_CONNECTIONS`` (Megatron set-ups use 1) is below the accelerator groups this
    rank talks on: each NCCL group is a stream of its own, streams then share hardware queues, and an operation
    queued behind a receive still waiting for its peer blocks the queue (a gradient receive posted right after a
    forward can hold up the next stage's activations). None where there is nothing to say."""
    env = os.environ if env is None else env
    value = env.get("CUDA_DEVICE_MAX_CONNECTIONS")
    if not on_device or value is None or not value.strip().isdigit() or int(value) >= accelerator_groups:
        return None
    return (f"hethub: warning: CUDA_DEVICE_MAX_CONNECTIONS={value} is below the {accelerator_groups} NCCL/RCCL "
            f"groups this rank uses (one stream each): queued behind a waiting receive, transfers can stall; unset "
            f"it or set it to at least {accelerator_groups}")
