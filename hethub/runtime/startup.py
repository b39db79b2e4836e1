"""``hethub.initialize``: DeepSpeed's pipeline engine under a heterogeneous plan.

Order matters: everything that can be wrong with the user's input (plan file, plan vs launched
world, plan vs layer list, config batch keys) is checked on every rank *before* the first
collective, and ends every rank with the same one line and exit code 2. Nothing hangs waiting
for a rank that already left.
"""
from __future__ import annotations

import argparse
import atexit
import datetime
import hashlib
import importlib
import json
import os
import sys
from typing import Any, Callable, NoReturn, Optional, Sequence, Union

from pydantic import Field, field_validator

from . import tp
from ..emulated.slowdown import MAX_SLOWDOWN, parse_factors, slowdown_for
from ..partitioner.errors import InputError, print_error
from ..partitioner.records import Plan, Record, load_plan, parse_record
from ..models.ties import find_ties, resolve_tied_specs

DEFAULT_TIMEOUT_S = 300


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``--hetero-plan`` the way ``deepspeed.add_config_arguments`` adds ``--deepspeed_config``."""
    group = parser.add_argument_group("hethub", "heterogeneous pipeline plan")
    group.add_argument("--hetero-plan", "--hetero_plan", dest="hetero_plan", default=None,
                       help="plan.json written by `hethub plan` (overrides ds_config['hetero']['plan'])")
    group.add_argument("--hetero-resume", "--hetero_resume", dest="hetero_resume", default=None, metavar="DIR",
                       help="load the newest complete checkpoint in DIR at initialize (any plan's checkpoint)")
    return parser


def fail(message: str) -> NoReturn:
    """One line on stderr, exit 2 (on every rank: each rank reaches the same verdict from the same input)."""
    print_error(message)
    raise SystemExit(2)


def _load_config(config: Union[dict, str, None]) -> dict:
    if config is None:
        return {}
    if isinstance(config, dict):
        return json.loads(json.dumps(config))  # deep copy; we fill in batch keys
    from ..partitioner.records import read_data_file
    data = read_data_file(str(config), "config")  # JSON (YAML also accepted)
    if not isinstance(data, dict):
        raise InputError("config", f"{config}: expected a JSON object, got {type(data).__name__}")
    return data


MAX_TIMEOUT_S = 7 * 86400  # a week: past it a timeout is a typo


class HeteroSection(Record):
    """ds_config's ``"hetero"`` section, checked whole on every rank before any collective.

    Why: a misspelt key (``"timout_s"``) would otherwise be a setting silently ignored, and a bad value a
    traceback halfway through start-up; here either is one line naming ``config.hetero.<field>``.
    """
    plan: Optional[Union[str, dict]] = None  # plan.json, or the plan itself (overridden by plan= and --hetero-plan)
    schedule: Optional[str] = None  # a hand-edited schedule file (``hethub simulate --print-schedule``'s format)
    resume: Optional[str] = None  # load the newest complete checkpoint in this directory at initialize
    emulate_slowdown: Optional[dict[str, float]] = None  # {device type: k}: emulated heterogeneity (hethub.emulation)
    timeout_s: float = Field(DEFAULT_TIMEOUT_S, gt=0, le=MAX_TIMEOUT_S)  # torch.distributed's, for every collective

    @field_validator("emulate_slowdown")
    @classmethod
    def _slowdowns(cls, value: Optional[dict[str, float]]) -> Optional[dict[str, float]]:
        for name, k in (value or {}).items():
            if not 1.0 <= k <= MAX_SLOWDOWN:
                raise ValueError(f"{name}: must be in [1, {MAX_SLOWDOWN:g}], got {k!r}")
        return value


def hetero_section(config: dict) -> HeteroSection:
    """The checked ``"hetero"`` section of a ds_config dict (an absent section is all defaults)."""
    return parse_record(HeteroSection, config.get("hetero") or {}, "config.hetero")


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
        from ..partitioner.records import parse_record
        return parse_record(Plan, plan, "plan")
    return load_plan(str(plan))


def launched_world() -> tuple[int, int]:
    """(rank, world size) of this process, from torch.distributed or the launcher's environment."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    try:
        return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        raise InputError("env", f"RANK/WORLD_SIZE must be integers, got RANK={os.environ.get('RANK')!r} "
                                f"WORLD_SIZE={os.environ.get('WORLD_SIZE')!r}") from None


def detected_device_type() -> Optional[str]:
    """This rank's accelerator name when one can be detected (None on CPU). HETHUB_DEVICE_TYPE overrides."""
    if os.environ.get("HETHUB_DEVICE_TYPE"):
        return os.environ["HETHUB_DEVICE_TYPE"]
    import torch
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.cuda.current_device())
    return None


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
    detected = detected_device_type()
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
    if (config.get("fp16") or {}).get("enabled"):
        raise InputError("config.fp16.enabled", "fp16 (loss-scaled) training is not supported yet; use bf16 or fp32")


def load_checked_schedule(plan: Plan, path: str, rank: int) -> list:
    """A hand-edited schedule file (``hetero.schedule``), checked before any collective: every rank's list
    present, transfers matched, structure sound, and a dry run that finishes (a deadlock names rank and step)."""
    from ..partitioner.costmodel import CostModel
    from ..partitioner.schedule import read_schedule_file
    from ..partitioner.simulator import simulate
    sched = read_schedule_file(str(path))
    simulate(plan, CostModel(plan.cluster, plan.model), sched)
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


def _fix_local_rank(plan: Plan, rank: int) -> None:
    """Point LOCAL_RANK at the device the plan gives this rank.

    DeepSpeed's per-node launcher sets LOCAL_RANK = rank % procs-on-this-node, which rotates the
    rank -> slot mapping when nodes run different numbers of ranks. The visible devices of a node are
    the plan's slots on it, in ascending order; this rank's device is its slot's position among them.
    ``hethub launch --local`` runs every rank on one machine: there the local index is the rank.
    """
    local = rank if os.environ.get("HETHUB_LOCAL") == "1" else plan_local_index(plan, rank)
    os.environ["LOCAL_RANK"] = str(local)
    import torch
    if torch.cuda.is_available() and local < torch.cuda.device_count():
        torch.cuda.set_device(local)


def _init_distributed(timeout_s: float) -> None:
    import deepspeed
    import torch.distributed as dist
    from deepspeed.accelerator import get_accelerator
    if dist.is_initialized():
        return
    if get_accelerator().device_name() == "cpu":
        # deepspeed.comm's TorchBackend JIT-compiles a shared-memory all-reduce op (~40 s) that
        # pipeline training never uses. `deepspeed.comm.torch` must be reached through importlib:
        # `deepspeed.comm.torch` as an attribute is the torch package (deepspeed.comm re-exports it).
        importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo" if get_accelerator().device_name() == "cpu" else None,
                               timeout=datetime.timedelta(seconds=timeout_s), verbose=False)


def _digest(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "big")  # < 2**56: an int64


def _check_every_rank_agrees(plan: Plan) -> None:
    """The first collective: every rank runs the same plan under the same hethub version.

    Why: on several hosts each host reads its own copy of plan.json (and has its own install). Ranks
    under different plans would pair transfers that do not match and hang or train wrongly; here every
    rank ends with exit 2 and one line naming the ranks that differ from rank 0.
    """
    import torch
    import torch.distributed as dist
    from .._version import __version__
    mine = torch.tensor([_digest(plan.to_json()), _digest(__version__)], dtype=torch.int64)
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    for i, what in ((0, "plan"), (1, "hethub version")):
        differ = [r for r, d in enumerate(every) if int(d[i]) != int(every[0][i])]
        if differ:
            fail(f"{what}: rank(s) {', '.join(map(str, differ[:20]))} run another {what} than rank 0 (each host "
                 f"reads its own copy: give every host the same {'plan file' if i == 0 else 'hethub'})")


_SHUTDOWN_BARRIER_S = 60.0  # how long a finished rank waits at exit for the others to finish too
_failed = False  # an uncaught exception on this rank: skip the barrier, end at once so peers see it


def _register_clean_shutdown() -> None:
    """At interpreter exit: a bounded barrier, then ``destroy_process_group``.

    Why: ranks that finish at different times (rank 0 doing extra work at the end) otherwise tear down
    gloo while peers still talk to them, and a process can abort at exit ("terminate called without an
    active exception", SIGABRT) though its training finished. After an uncaught exception the rank
    prints its traceback and ends at once, so its peers' transfers fail within seconds and name it.
    """
    previous_hook = sys.excepthook

    def excepthook(kind, value, tb):
        global _failed
        _failed = True
        previous_hook(kind, value, tb)

    def at_exit():
        import torch.distributed as dist
        if not dist.is_initialized():
            return
        if _failed:
            sys.stderr.flush()
            os._exit(1)  # gloo's threads could keep a failed process alive; its peers must see it gone
        try:
            if dist.get_backend() == "gloo":
                dist.monitored_barrier(timeout=datetime.timedelta(seconds=_SHUTDOWN_BARRIER_S))
            else:
                dist.barrier()
        except RuntimeError as exc:
            first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
            sys.stderr.write(f"hethub: rank {dist.get_rank()} finished, but not every rank reached the final "
                             f"barrier: {first}\n")  # one write: the ranks share one stderr pipe
            sys.stderr.flush()
            os._exit(3)
        dist.destroy_process_group()

    sys.excepthook = excepthook
    atexit.register(at_exit)


def _emulated(layers: Sequence[Any], grid, hetero: HeteroSection) -> Sequence[Any]:
    """This stage's layers wrapped in the emulated slowdown of its device type, where one is set."""
    slowdown = slowdown_for(grid.device_type, hetero.emulate_slowdown)
    if slowdown == 1.0:
        return layers
    from ..emulated.slowdown import SlowDown
    first, last = grid.stage.layers
    layers = list(layers)
    layers[first:last] = [SlowDown(layer, slowdown) for layer in layers[first:last]]
    return layers


def _stage_zero1(plan: Plan, rank: int) -> bool:
    """Whether the plan shards the optimizer state of this rank's stage (the stage's own ``zero1``)."""
    return plan.stages[plan.locate(rank)[0]].zero1


def _set_batch_keys(cfg: dict, plan: Plan, grid) -> None:
    """DeepSpeed's own batch bookkeeping, per rank: this replica's rows x micro-batches x stage width."""
    samples = grid.sample_stop - grid.sample_start
    cfg["train_micro_batch_size_per_gpu"] = samples
    cfg["gradient_accumulation_steps"] = plan.num_micro_batches
    cfg["train_batch_size"] = samples * plan.num_micro_batches * grid.data_parallel_size
    cfg.setdefault("steps_per_print", 10 ** 9)


def initialize(layers: Sequence[Any], loss_fn: Optional[Callable] = None, config: Union[dict, str, None] = None,
               plan: Union[Plan, str, None] = None, optimizer: Any = None, model_parameters: Any = None,
               lr_scheduler: Any = None, args: Any = None, tp_plan: Optional[dict] = None):
    """Build the stage of ``layers`` this rank runs under ``plan``; returns (engine, optimizer, None, lr_scheduler).

    ``layers`` is the full model in pipeline order (layer i = planner layer i of the plan's model);
    ``loss_fn(outputs, labels)`` returns the mean loss over the samples it is given. ``optimizer``
    may be a callable ``params -> torch.optim.Optimizer`` (it then sees only this stage's
    parameters), an optimizer already built, or left to the ds_config's "optimizer" section. With
    ZeRO-1 hethub then replaces each of its parameter groups by this replica's flat shard (hethub.zero).
    ``tp_plan`` ({fnmatch pattern over "{layer index}.{submodule}": "colwise" | "rowwise"}) splits a user's
    layers in stages with tensor_parallel > 1; hethub's own blocks need none (hethub.tp).
    """
    try:
        cfg = _load_config(config if config is not None else getattr(args, "deepspeed_config", None))
        hetero = hetero_section(cfg)
        parse_factors(os.environ.get("HETHUB_EMULATE_SLOWDOWN", ""))  # a bad one is one line here, not mid-start
        the_plan = resolve_plan(plan, hetero, args)
        rank, world = launched_world()
        layers = resolve_tied_specs(layers)  # TiedLayerSpec: one module per key, shared
        ties = find_ties(layers)
        check_against_world(the_plan, rank, world, layers, cfg, optimizer)
        tp_plan = tp.check_tp_plan(tp_plan)
        tp.check_layers(the_plan, layers, tp_plan)
        schedule = load_checked_schedule(the_plan, hetero.schedule, rank) if hetero.schedule else None
        from . import ds_seams
        ds_seams.check()
    except InputError as exc:
        fail(str(exc))

    import deepspeed  # noqa: F401  (after the checks: a bad plan fails fast, before the heavy import)
    import torch
    from deepspeed.runtime.config import DeepSpeedConfig

    from .engine import HeteroPipelineEngine, HeteroPipelineModule
    from .grid import HeteroGrid
    from .zero import Zero1

    cfg.pop("hetero", None)  # hethub's own: DeepSpeed's config does not know it
    # bf16: autocast compute with fp32 weights, gradients and optimizer state (hethub runs it, not DeepSpeed's
    # BF16_Optimizer, whose gradient bookkeeping assumes equal widths).
    bf16 = bool((cfg.pop("bf16", None) or {}).get("enabled"))
    # ZeRO-1: hethub shards the optimizer itself (hethub.zero); DeepSpeed's engine sees plain data parallelism.
    zero1 = (cfg.pop("zero_optimization", None) or {}).get("stage", 0) == 1
    zero1 = zero1 or _stage_zero1(the_plan, rank)  # a stage the plan shards (its memory assumes it)
    _fix_local_rank(the_plan, rank)
    _init_distributed(hetero.timeout_s)
    _register_clean_shutdown()
    _check_every_rank_agrees(the_plan)
    grid = HeteroGrid(the_plan, rank, ties)
    if grid.tp > 1:  # split this stage's layers over the replica's tensor-parallel group (hethub.tp)
        from deepspeed.accelerator import get_accelerator
        from torch.distributed.device_mesh import DeviceMesh
        grid.tp_mesh = DeviceMesh.from_group(grid.tp_group, get_accelerator().device_name())
        first, last = grid.stage.layers
        for layer in layers[first:last]:  # on the device before splitting (DeepSpeed then leaves them there)
            if hasattr(layer, "to"):
                layer.to(get_accelerator().current_device_name())
        tp.parallelize(first, layers[first:last], tp_plan, grid.tp_mesh)
    module = HeteroPipelineModule(_emulated(layers, grid, hetero), loss_fn, grid)
    _set_batch_keys(cfg, the_plan, grid)
    params = [p for p in module.parameters() if p.requires_grad]
    if callable(optimizer) and not hasattr(optimizer, "step"):
        optimizer = optimizer(params)
    if model_parameters is None and optimizer is None:
        model_parameters = params
    config_class = DeepSpeedConfig(cfg, grid)
    engine = HeteroPipelineEngine(plan=the_plan, grid=grid, module=module, config=cfg, config_class=config_class,
                                  optimizer=optimizer, model_parameters=model_parameters, lr_scheduler=lr_scheduler,
                                  schedule=schedule)
    engine.autocast_dtype = torch.bfloat16 if bf16 else None
    engine.emulate_slowdown = slowdown_for(grid.device_type, hetero.emulate_slowdown)
    engine.ties = ties
    if zero1 and grid.data_parallel_size > 1:
        try:
            engine.zero1 = Zero1(engine.optimizer, params, grid.replica_id, grid.data_parallel_size)
        except ValueError as exc:
            fail(str(exc))
    resume = getattr(args, "hetero_resume", None) or hetero.resume
    if resume:
        engine.load_checkpoint(resume)
    return engine, engine.optimizer, None, engine.lr_scheduler
