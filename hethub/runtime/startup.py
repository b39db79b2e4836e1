"""``hethub.initialize``: DeepSpeed's pipeline engine under a heterogeneous plan, built in order.

Order matters, and ``_build`` reads as it:

1. the ds_config is read and validated once (``RunConfig``); an elastic run then starts its world first, to
   agree on the plan for the ranks present (``_elastic_start``);
2. everything that can be wrong with the user's input is checked on every rank *before* the first collective
   (``_check_inputs``, ``checks``), and ends every rank with the same one line and exit code 2;
3. the world, every rank agreeing on the plan (``_start_world``), then the process groups (``grid``);
4. the stage's layers (``module``), split for tensor parallelism and wrapped by an emulated device type
   (``hethub.emulated.device``) where either applies;
5. the engine, given DeepSpeed's arguments and everything else as one ``engine.StageParts``.

Nothing hangs waiting for a rank that already left: a rank that fails later ends at once, and its peers name it
(``errors.Guard``).
"""
from __future__ import annotations

import argparse
import atexit
import datetime
import hashlib
import importlib
import inspect
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Union

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.config import DeepSpeedConfig

from .._version import __version__
from ..dsconfig import DEFAULT_JOIN_TIMEOUT_S, DEFAULT_TIMEOUT_S, HeteroSection, hetero_section, load_config
from ..emulated.device import EmulatedDevice
from ..emulated.device import for_rank as emulated_device
from ..emulated.pinned import check_pin_profiles, load_pin_profiles
from ..emulated.slowdown import parse_factors, slowdown_for
from ..events import request_stop
from ..models.ties import find_ties, resolve_tied_specs
from ..partitioner.errors import InputError
from ..partitioner.groups import GLOO, world_start
from ..partitioner.outputs import count
from ..partitioner.records import Plan, Profile
from . import capture, ds_seams, elastic, frontdoor, join, tp
from .checks import (check_against_world, connections_note, launched_world, load_checked_schedule,
                     local_device_index, on_gpu, resolve_plan)
from .control import Control
from .precision import Precision, check_device_dtype, plan_dtype_note, precision_from_config
from .engine import Autosave, HeteroPipelineEngine, StageParts
from .errors import fail, first_line, mark_ending, on_fail
from .grid import HeteroGrid
from .module import HeteroPipelineModule
from .zero import Zero1

__all__ = ["initialize", "add_config_arguments", "DEFAULT_TIMEOUT_S"]


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``--hetero-plan`` the way ``deepspeed.add_config_arguments`` adds ``--deepspeed_config``."""
    group = parser.add_argument_group("hethub", "heterogeneous pipeline plan")
    group.add_argument("--hetero-plan", "--hetero_plan", dest="hetero_plan", default=os.environ.get("HETHUB_PLAN"),
                       help="plan.json written by `hethub plan` (hethub launch --hetero-plan gives it; it must "
                            "agree with ds_config['hetero']['plan'] where both are given)")
    group.add_argument("--hetero-resume", "--hetero_resume", dest="hetero_resume", default=None, metavar="DIR",
                       help="load the newest complete checkpoint in DIR at initialize (any plan's checkpoint)")
    return parser


@dataclass(frozen=True)
class RunConfig:
    """The ds_config, read and validated once: DeepSpeed's part (``ds``: what hethub runs itself taken out), the
    ``hetero`` section, the precision (bf16/fp16 are hethub's, not DeepSpeed's optimizer wrappers) and whether the
    ds_config asks for ZeRO-1 (hethub shards the optimizer itself, ``hethub.runtime.zero``; its section stays in
    ``ds`` until checked against the plan, and DeepSpeed never sees it)."""
    ds: dict
    hetero: HeteroSection
    precision: Precision
    zero1: bool

    @property
    def autosave(self) -> Autosave:
        return Autosave(self.hetero.checkpoint_dir, self.hetero.checkpoint_every, self.hetero.checkpoint_background)


def read_config(config, args) -> RunConfig:
    """``config`` (a dict or a file; else ``args.deepspeed_config``) read once; bad input is one line, exit 2."""
    try:
        cfg = load_config(config if config is not None else getattr(args, "deepspeed_config", None))
        hetero = hetero_section(cfg)
        precision = precision_from_config(cfg)  # takes bf16/fp16 out of cfg
        cfg.pop("hetero", None)  # hethub's own: DeepSpeed's config does not know it
        zero = cfg.get("zero_optimization") or {}  # checked against the plan with it (dsconfig.check_zero)
        zero1 = isinstance(zero, dict) and zero.get("stage", 0) == 1
    except InputError as exc:
        fail(str(exc))
    return RunConfig(cfg, hetero, precision, zero1)


class _Checked:
    """The inputs of one start, all checked (``_check_inputs``) before any collective."""

    def __init__(self, config: RunConfig, plan: Plan, rank: int, layers: list, ties: tuple,
                 tp_plan: Optional[dict], schedule: Optional[list], pin_profiles: Optional[list[Profile]]):
        self.config, self.plan, self.rank = config, plan, rank
        self.layers, self.ties, self.tp_plan, self.schedule = layers, ties, tp_plan, schedule
        self.pin_profiles = pin_profiles  # HETHUB_EMULATE_PROFILES (emulation only)

    @property
    def hetero(self) -> HeteroSection:
        return self.config.hetero


def _check_inputs(layers, config: RunConfig, plan, optimizer, args, tp_plan, built: bool = False) -> _Checked:
    """Every check that needs no other rank; a failure is one line and exit 2 on every rank."""
    hetero = config.hetero
    try:
        parse_factors(os.environ.get("HETHUB_EMULATE_SLOWDOWN", ""))  # a bad one is one line here, not mid-start
        pin_profiles = load_pin_profiles()
        # an elastic start resolved it already, and gives the plan for the ranks present
        the_plan = plan if hetero.elastic else resolve_plan(plan, hetero, args)
        rank, world = launched_world()
        # TiedLayerSpec: one module per key, shared; LayerSpecs built in list order, this rank's kept
        layers = resolve_tied_specs(layers, None if built else the_plan.rank_layers(rank))
        ties = tuple(find_ties(layers))
        check_against_world(the_plan, rank, world, layers, config.ds, optimizer)
        tp_plan = tp.check_tp_plan(tp_plan)
        tp.check_layers(the_plan, layers, tp_plan)
        schedule = load_checked_schedule(the_plan, hetero.schedule, rank) if hetero.schedule else None
        if pin_profiles is not None:
            check_pin_profiles(the_plan, pin_profiles, {t for st in the_plan.stages for t in st.types
                                                        if slowdown_for(t, hetero.emulate_slowdown) != 1.0})
        ds_seams.check()
    except InputError as exc:
        fail(str(exc))
    return _Checked(config, the_plan, rank, list(layers), ties, tp_plan, schedule, pin_profiles)


def _fix_local_rank(plan: Plan, rank: int) -> None:
    """Point LOCAL_RANK at the device the plan gives this rank.

    DeepSpeed's per-node launcher sets LOCAL_RANK = rank % procs-on-this-node, which rotates the
    rank -> slot mapping when nodes run different numbers of ranks. The visible devices of a node are
    the plan's slots on it, in ascending order; this rank's device is its slot's position among them.
    ``hethub launch --local`` runs every rank on one machine: there the local index is the rank.
    """
    local = local_device_index(plan, rank)
    os.environ["LOCAL_RANK"] = str(local)
    if on_gpu():  # checked before: the device exists
        torch.cuda.set_device(local)


def init_distributed(timeout_s: float, plan: Optional[Plan] = None,
                     join_timeout_s: float = DEFAULT_JOIN_TIMEOUT_S) -> None:
    """Create the world group, once, as ``partitioner.groups.world_start`` says for ``plan`` (gloo on CPU and
    where the plan spans vendors; the device bound only where no gloo subgroup of some ranks exists), then hand it
    to DeepSpeed's ``init_distributed`` (its own, where ``routing`` replaced it), which finds it. Every rank first
    joins on rank 0's store, waiting up to ``join_timeout_s`` (``join``); collectives then time out after
    ``timeout_s``. Shared with the adapters that start ranks themselves."""
    accel = get_accelerator()
    cpu = accel.device_name() == "cpu"
    start = world_start(plan, cpu)
    backend = "gloo" if start.backend == GLOO else accel.communication_backend_name()
    timeout = datetime.timedelta(seconds=timeout_s)
    if cpu:
        # deepspeed.comm's TorchBackend JIT-compiles a shared-memory all-reduce op (~40 s) that
        # pipeline training never uses. `deepspeed.comm.torch` must be reached through importlib:
        # `deepspeed.comm.torch` as an attribute is the torch package (deepspeed.comm re-exports it).
        importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    if not dist.is_initialized() and all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR",
                                                                    "MASTER_PORT")):
        kwargs: dict[str, Any] = {"timeout": timeout}
        if start.bind_device:
            kwargs["device_id"] = accel.device(int(os.environ.get("LOCAL_RANK", 0)))
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":  # an elastic agent's workers use its store
            kwargs.update(_joined_store(plan, join_timeout_s))
        dist.init_process_group(backend, **kwargs)
    # else DeepSpeed discovers the world (MPI) and creates it, binding CUDA devices as it does
    if not deepspeed.comm.is_initialized():
        inspect.unwrap(deepspeed.init_distributed)(dist_backend=backend, timeout=timeout, verbose=False)


def _joined_store(plan: Optional[Plan], join_timeout_s: float) -> dict[str, Any]:
    """``init_process_group``'s store, rank and world size, once every rank has joined on the store."""
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = join.open_store(rank, world_size, os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                            join_timeout_s)
    hosts = None
    if plan is not None and world_size == plan.world_size:
        hosts = [plan.stages[s].replicas[j].host for s, j in map(plan.locate, range(world_size))]
    join.join(store, rank, world_size, join_timeout_s, hosts)
    return {"store": store, "rank": rank, "world_size": world_size}


def _digest(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "big")  # < 2**56: an int64


def _check_every_rank_agrees(plan: Plan, control: Control) -> None:
    """The first collective: every rank runs the same plan under the same hethub version.

    Why: on several hosts each host reads its own copy of plan.json (and has its own install). Ranks
    under different plans would pair transfers that do not match and hang or train wrongly; here every
    rank ends with exit 2 and one line naming the ranks that differ from rank 0.
    """
    every = control.all_gather([_digest(plan.to_json()), _digest(__version__)])
    for i, what in ((0, "plan"), (1, "hethub version")):
        differ = [r for r, d in enumerate(every) if d[i] != every[0][i]]
        if differ:
            fail(f"{what}: rank(s) {', '.join(map(str, differ[:20]))} run another {what} than rank 0 (each host "
                 f"reads its own copy: give every host the same {'plan file' if i == 0 else 'hethub'})")


_SHUTDOWN_BARRIER_S = 60.0  # how long a finished rank waits at exit for the others to finish too
_failed = False  # an uncaught exception on this rank: skip the barrier, end at once so peers see it


def _register_clean_shutdown(control: Control) -> None:
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
        mark_ending()
        previous_hook(kind, value, tb)

    sys.excepthook = excepthook
    atexit.register(_at_exit, control)


def _at_exit(control: Control) -> None:
    if not dist.is_initialized():
        return
    if _failed:
        sys.stderr.flush()
        os._exit(1)  # gloo's threads could keep a failed process alive; its peers must see it gone
    try:
        control.barrier(_SHUTDOWN_BARRIER_S)
    except RuntimeError as exc:
        sys.stderr.write(f"hethub: rank {dist.get_rank()} finished, but not every rank reached the final "
                         f"barrier: {first_line(exc)}\n")  # one write: the ranks share one stderr pipe
        sys.stderr.flush()
        os._exit(3)
    dist.destroy_process_group()


def _stage_layers(run: _Checked, grid: HeteroGrid, emulated: Optional[EmulatedDevice]) -> list:
    """The layer list with this stage's layers split over its tensor-parallel group (hethub.runtime.tp) and
    wrapped by its emulated device type, where either applies."""
    layers = list(run.layers)
    for first, last in grid.stage.chunk_ranges:
        if grid.tp > 1:
            for layer in layers[first:last]:  # on the device before splitting (DeepSpeed then leaves them there)
                if hasattr(layer, "to"):
                    layer.to(get_accelerator().current_device_name())
            tp.parallelize(first, layers[first:last], run.tp_plan, grid.tp_mesh)
        if emulated is not None:
            layers[first:last] = emulated.wrap(layers[first:last], first)
    return layers


def _set_batch_keys(cfg: dict, plan: Plan, grid) -> None:
    """DeepSpeed's own batch bookkeeping, per rank: this replica's rows x micro-batches x stage width."""
    samples = grid.sample_stop - grid.sample_start
    cfg["train_micro_batch_size_per_gpu"] = samples
    cfg["gradient_accumulation_steps"] = plan.num_micro_batches
    cfg["train_batch_size"] = samples * plan.num_micro_batches * grid.data_parallel_size
    cfg.setdefault("steps_per_print", 10 ** 9)


def _stage_optimizer(params: list, optimizer: Any, model_parameters: Any, cfg: dict) -> tuple[Any, Any]:
    """(optimizer, model_parameters) for DeepSpeed's engine: a callable optimizer is given this stage's trainable
    parameters; a stage with none gets an empty one (and the ds_config's section is dropped for it). An optimizer
    built by the script must hold this stage's parameters: one built over another module's (a ``PipelineModule``
    DeepSpeed partitioned itself) would step tensors nothing trains, in silence."""
    if hasattr(optimizer, "param_groups") and params:
        held = {id(p) for g in optimizer.param_groups for p in g["params"]}
        if not all(id(p) in held for p in params):
            fail("optimizer: built over parameters other than this rank's stage's (another module's): build it over "
                 "the layers hethub runs (under `hethub launch` a PipelineModule's parameters() are this stage's), "
                 "or pass a callable params -> optimizer, or use the ds_config's \"optimizer\" section")
    if not params:  # every layer of this stage is frozen: it steps nothing, yet takes part in every collective
        cfg.pop("optimizer", None)
        return _no_parameters_optimizer(), None
    if callable(optimizer) and not hasattr(optimizer, "step"):
        optimizer = optimizer(params)
    if model_parameters is None and optimizer is None:
        model_parameters = params
    return optimizer, model_parameters


def _no_parameters_optimizer() -> torch.optim.Optimizer:
    """The optimizer of a stage with no trainable parameter (frozen embeddings and first blocks, fine-tuning): one
    empty parameter group, so that DeepSpeed's step, its learning-rate schedule and checkpoints run as on every
    other stage while nothing changes. The user's optimizer (a callable, or the ds_config's section) would refuse
    an empty parameter list."""
    return torch.optim.SGD([{"params": []}], lr=0.0)


def _zero1_factory(run: _Checked, grid: HeteroGrid, params: list, zero1: bool) -> Optional[Callable]:
    """ZeRO-1 for this replica, made from DeepSpeed's optimizer once it exists (a bad optimizer is one line)."""
    zero1 = zero1 or run.plan.shards_optimizer(grid.stage)  # a stage the plan shards (its memory assumes it)
    if not zero1 or grid.data_parallel_size == 1 or not params:  # a frozen stage has no state to shard
        return None

    def make(optimizer):
        try:
            if grid.mixed_tp:  # whole tensors over every rank of the stage, in its group's order (hethub.runtime.zero)
                group = grid.get_data_parallel_group()
                return Zero1(optimizer, params, dist.get_rank(group), len(grid.dp_ranks), whole=True)
            return Zero1(optimizer, params, grid.replica_id, grid.data_parallel_size)
        except ValueError as exc:
            fail(str(exc))
    return make


def _elastic_start(config: RunConfig, plan, args) -> tuple[Any, Optional[Control]]:
    """Under ``"hetero": {"elastic": true}`` (``hethub launch --elastic``): start the world the agent launched and
    return the plan for the ranks present (``hethub.runtime.elastic``) and the control channel it was agreed on;
    else ``plan`` unchanged and None. Collective."""
    hetero = config.hetero
    if not hetero.elastic:
        return plan, None
    try:
        # Bad input from here on is the same at every restart: the job ends (every host's launcher sees the line)
        on_fail(lambda message: request_stop(hetero.checkpoint_dir, message))
        base = resolve_plan(plan, hetero, args)
        elastic.this_host(base)  # before any collective: a worker that cannot say where it runs ends here
    except InputError as exc:
        fail(str(exc))
    init_distributed(hetero.timeout_s, base, hetero.join_timeout_s)
    control = Control(hetero.timeout_s)
    try:
        return elastic.elastic_plan(base, control, hetero.checkpoint_dir), control
    except InputError as exc:
        fail(str(exc))


def initialize(layers: Optional[Sequence[Any]] = None, loss_fn: Optional[Callable] = None,
               config: Union[dict, str, None] = None, plan: Union[Plan, str, None] = None, optimizer: Any = None,
               model_parameters: Any = None, lr_scheduler: Any = None, args: Any = None,
               tp_plan: Optional[dict] = None, *, model: Any = None, training_data: Any = None,
               collate_fn: Optional[Callable] = None):
    """Build the stage of the model this rank runs under ``plan``; returns (engine, optimizer, training data
    loader or None, lr_scheduler), as ``deepspeed.initialize`` does.

    The model: ``layers`` (the full model in pipeline order: layer i = planner layer i of the plan's model) or
    DeepSpeed's ``model=`` (a ``PipelineModule``, whose specs and ``loss_fn`` are used and whose own partition the
    plan replaces; an ``nn.Sequential``; a list). ``loss_fn(outputs, labels)`` returns the mean loss over the
    samples it is given. ``optimizer`` may be a callable ``params -> torch.optim.Optimizer`` (it then sees only
    this stage's parameters), an optimizer already built, or left to the ds_config's "optimizer" section (over
    this stage's trainable parameters: with ``model=`` they replace ``model_parameters``). With ZeRO-1 hethub
    then replaces each of its parameter groups by this replica's flat shard (hethub.runtime.zero).
    ``training_data`` (a dataset): ``train_batch()`` without an iterator reads it (``frontdoor``).
    ``tp_plan`` ({fnmatch pattern over "{layer index}.{submodule}": "colwise" | "rowwise"}) splits a user's
    layers in stages with tensor_parallel > 1; hethub's own blocks need none (hethub.runtime.tp).
    """
    layers, loss_fn, note, built = frontdoor.model_layers(layers, model, loss_fn)
    if capture.capturing():  # hethub profile --script: the model is measured, not trained
        return capture.capture_engine(layers, loss_fn, training_data, collate_fn)
    if model is not None:
        model_parameters = None  # another module's (or none, under a plan): this stage's own are used
    engine = _build(layers, loss_fn, config, plan, optimizer, model_parameters, lr_scheduler, args, tp_plan, note,
                    built)
    loader = frontdoor.attach_training_data(engine, training_data, collate_fn)
    return engine, engine.optimizer, loader, engine.lr_scheduler


def _build(layers, loss_fn, config, plan, optimizer, model_parameters, lr_scheduler, args, tp_plan, note: str,
           built: bool):
    """The engine of this rank's stage (``initialize``); ``built``: this rank's layers are built already."""
    run_config = read_config(config, args)
    plan, control = _elastic_start(run_config, plan, args)
    run = _check_inputs(layers, run_config, plan, optimizer, args, tp_plan, built)
    cfg = dict(run_config.ds)
    cfg.pop("zero_optimization", None)  # ZeRO-1 is hethub's; DeepSpeed's engine sees plain data parallelism
    control = _start_world(run, control, note)
    grid = HeteroGrid(run.plan, run.rank, run.ties, device_name=get_accelerator().device_name(),
                      timeout_s=run.hetero.timeout_s)
    line = connections_note(sum(1 for g in grid.my_groups() if not grid.on_host(g)), on_gpu())
    if line:
        print(line, file=sys.stderr, flush=True)
    emulated = emulated_device(run.plan, grid, run.hetero.emulate_slowdown, run.pin_profiles, run.schedule)
    module = HeteroPipelineModule(_stage_layers(run, grid, emulated), loss_fn, grid)
    _set_batch_keys(cfg, run.plan, grid)
    params = [p for p in module.parameters() if p.requires_grad]
    optimizer, model_parameters = _stage_optimizer(params, optimizer, model_parameters, cfg)
    parts = StageParts(
        plan=run.plan, grid=grid, module=module, control=control, precision=run_config.precision, ties=run.ties,
        schedule=run.schedule, zero1=_zero1_factory(run, grid, params, run_config.zero1),
        bucket_bytes=int(run.hetero.bucket_mb * 2**20), autosave=run_config.autosave,
        heartbeat=elastic.Heartbeat(run.hetero.checkpoint_dir) if run.hetero.elastic and run.rank == 0 else None,
        emulated=emulated)
    engine = HeteroPipelineEngine(parts, config=cfg, config_class=DeepSpeedConfig(cfg, grid), optimizer=optimizer,
                                  model_parameters=model_parameters, lr_scheduler=lr_scheduler)
    resume = getattr(args, "hetero_resume", None) or run.hetero.resume
    if run.hetero.elastic and elastic.newest_checkpoint(run.hetero.checkpoint_dir):
        resume = run.hetero.checkpoint_dir  # the newest complete checkpoint, whichever plan wrote it
    if resume:
        path, _ = engine.load_checkpoint(resume)
        if run.rank == 0:
            print(f"hethub: resumed from {path} at step {engine.global_steps} ({engine.global_samples} samples seen)",
                  file=sys.stderr, flush=True)
    return engine


def _start_world(run: _Checked, control: Optional[Control], note: str) -> Control:
    """This rank's device, the world (every rank agreeing on the plan) and the control channel (an elastic start
    made it already); rank 0 says what it starts and any note on the model or the precision."""
    _fix_local_rank(run.plan, run.rank)
    try:
        check_device_dtype(run.config.precision, torch.device(get_accelerator().current_device_name()))
    except InputError as exc:
        fail(str(exc))
    init_distributed(run.hetero.timeout_s, run.plan, run.hetero.join_timeout_s)
    control = control or Control(run.hetero.timeout_s)
    _register_clean_shutdown(control)
    _check_every_rank_agrees(run.plan, control)
    if run.rank == 0:  # the first line a launch prints after its ranks' silent imports
        print(f"hethub: {count(run.plan.world_size, 'rank')} joined and agree on the plan "
              f"({count(run.plan.num_stages, 'stage')}); building them", file=sys.stderr, flush=True)
        for line in (note, plan_dtype_note(run.plan, run.config.precision)):
            if line:
                print(line, file=sys.stderr, flush=True)
    return control
