"""The planner: for a cluster, a model and a global batch, the plan of least predicted iteration time.

It searches every micro-batch size, each as its own sub-problem (``search.candidates.Job``): models of identical
blocks longer than ``SHAPES_MIN_LAYERS`` through the shape search (``search.shapes``: how many stages of each
shape), others through the chain search (``search.chain``: which chain of candidate stages, exact over every order
of vendors). Both solve MILPs through one solver layer (``search.milp``) and price chains with one function
(``search.candidates.objective_of``); the best few plans are then replayed event by event (``evaluate``) and the
fastest replay wins, with the proven gap of the search beside it.
"""
from __future__ import annotations

import math
import time
from dataclasses import replace
from typing import Callable, Optional

import numpy as np

from .costmodel import CostModel
from .errors import InfeasibleError, InputError
from .evaluate import REPLAY_WITHIN
from .placement import StageLayout, even_split
from .records import MAX_MICRO_BATCHES
from .schedule import SCHEDULES
from .options import PlannerOptions
from .search.candidates import (Job, Solution, candidates, objective_of, restrict,
                                tensor_parallel_degrees, units_for)
from .search.chain import bottleneck_lower_bound, incumbent, solve_brute_force, solve_milp, sum_lower_bound
from .search.milp import OPTIMAL_GAP
from .search.shapes import ShapeSearch, identical_blocks
from .schedule_kinds import kind as schedule_kind


# Models of identical blocks with more planner layers than this go to the shape MILP (``shapes``): on the
# 4-type benchmark (llama-7b, 34 layers, 64 devices) it proves its plan optimal in 11-13 s where the chain MILP
# ends its 60 s at a 28% gap. Shorter models keep the chain MILP, exact over every order of vendors.
SHAPES_MIN_LAYERS = 16


def micro_batch_sizes(global_batch: int, opts: PlannerOptions) -> list[int]:
    if opts.micro_batch_sizes:
        bad = [b for b in opts.micro_batch_sizes if b < 1 or global_batch % b]
        if bad:
            raise InfeasibleError("micro_batch_sizes", f"{bad[0]} does not divide the global batch {global_batch}")
        sizes = sorted(opts.micro_batch_sizes)
    else:
        sizes = [b for b in range(1, min(global_batch, opts.max_micro_batch_size) + 1) if global_batch % b == 0]
    out = [b for b in sizes if global_batch // b <= MAX_MICRO_BATCHES]
    if sizes and not out:
        raise InfeasibleError("global_batch", f"{global_batch} needs more than {MAX_MICRO_BATCHES} micro-batches at "
                                                f"micro-batch sizes up to {max(sizes)}; allow larger ones "
                                                f"(--max-micro-batch / --micro-batch-sizes)")
    return out


class _Search:
    """The search state over micro-batch sizes: incumbent, per-job bounds, the best chain per job."""

    def __init__(self, cm: CostModel, global_batch: int, opts: PlannerOptions, progress):
        self.cm, self.global_batch, self.opts, self.progress = cm, global_batch, opts, progress
        counts_all = cm.cluster.count_by_type()
        self.types = list(opts.device_types or cm.cluster.type_names)
        for t in self.types:
            if t not in counts_all:
                raise InputError("device_types", f"cluster {cm.cluster.name!r} has no {t!r} devices")
        self.counts = [counts_all[t] for t in self.types]
        self.U = len(units_for(cm.model, opts.max_units))
        self.sizes = micro_batch_sizes(global_batch, opts)
        self.t0 = time.perf_counter()
        self.brute = opts.solver == "brute-force"  # the reference: no bounding, every chain of every size
        self.best: Optional[Solution] = None
        self.pool: dict[tuple, Solution] = {}  # the best chain found per job
        self.milp_vars = 0
        self.jobs = self._make_jobs()
        self.bounds = {j.key: j.lower_bound_s for j in self.jobs}
        self.solved: dict[tuple, bool] = {}

    def _make_jobs(self) -> list[Job]:
        """Candidates and lower bounds per job, most promising first."""
        opts, U, N = self.opts, self.U, sum(self.counts)
        units = units_for(self.cm.model, opts.max_units)
        # With equal widths, each (micro-batch size, width) pair is its own sub-problem.
        keys = ([(b, w) for b in self.sizes for w in range(1, min(b, max(self.counts)) + 1) if b % w == 0]
                if opts.equal_widths else [(b, None) for b in self.sizes])
        jobs = []
        for b, w in keys:
            M = self.global_batch // b
            cand = candidates(self.cm, units, b, M, self.types, dict(zip(self.types, self.counts)),
                              opts.allow_recompute, width=w, max_tp=opts.max_tensor_parallel, mixed=opts.mixed_types,
                              schedule=opts.schedule, zero1=opts.zero1_stages,
                              overlap=opts.network == "overlap")
            t_lb = bottleneck_lower_bound(cand, U, N, M) if len(cand) else math.inf
            lb = (M - 1) * t_lb + sum_lower_bound(cand, U, N, M) if math.isfinite(t_lb) else math.inf
            jobs.append(Job(lb, b, M, cand, t_lb, w))
        return sorted(jobs, key=lambda j: j.lower_bound_s)

    def offer(self, sol: Solution, key: tuple) -> None:
        if key not in self.pool or sol.objective < self.pool[key].objective:
            self.pool[key] = sol
        if self.best is None or sol.objective < self.best.objective:
            self.best = sol

    def beaten(self, bound: float) -> bool:
        """No chain of that job could be replayed: its bound is past the replay window of the incumbent."""
        return self.best is not None and bound >= self.cutoff() * (1 - 1e-9)

    def cutoff(self) -> Optional[float]:
        """Each job's MILP looks for its best chain within ``REPLAY_WITHIN`` of the incumbent, not only below it:
        the closed form ranks, the replay decides (``choose_by_simulation``), and a chain a little above the
        incumbent by the closed form can replay faster (under zb-h1 the drain's overlap is not in the MILP)."""
        return None if self.best is None or self.brute else self.best.objective * REPLAY_WITHIN

    def seed_incumbents(self) -> None:
        """Heuristic chains for every job: the MILPs then only look below the best."""
        for job in self.jobs:
            if math.isfinite(job.t_lb):
                chain = incumbent(job.cand, self.U, self.counts, job.M, job.t_lb, one_run=self.opts.equal_widths)
                if chain is not None:
                    self.offer(Solution(job.key[0], job.M, chain, objective_of(job.cand, chain, job.M),
                                        job.lower_bound_s, "feasible", job.cand), job.key)

    def attempt(self, job: Job, seconds: float) -> None:
        """Solve one job (restricted to candidates that can beat the incumbent) within ``seconds``."""
        if not self.brute and (not math.isfinite(job.lower_bound_s) or self.beaten(job.lower_bound_s)):
            self.solved[job.key] = True
            return
        cut = self.cutoff()
        sub, back = (restrict(job.cand, job.cand.pace_s <= cut / job.M * (1 + 1e-9)) if cut is not None
                     else (job.cand, np.arange(len(job.cand))))
        if self.brute:
            res = solve_brute_force(sub, self.U, self.counts, job.M, deadline=self.t0 + self.opts.time_limit_s,
                                    time_limit_s=self.opts.time_limit_s, one_run=self.opts.equal_widths)
            chosen, obj, bound, status = (None, math.inf, math.inf, "infeasible") if res is None else \
                (res[0], res[1], res[1], "optimal")
        else:
            self.milp_vars += len(sub)
            chosen, obj, bound, status = solve_milp(sub, self.U, self.counts, job.M, self.opts.solver, seconds,
                                                    z_lower=job.t_lb, cutoff=cut, one_run=self.opts.equal_widths)
        self.bounds[job.key] = max(self.bounds[job.key], bound if status != "infeasible" else
                                   (cut if cut is not None else math.inf))
        self.solved[job.key] = status in ("optimal", "infeasible")
        if self.progress is not None:
            self.progress({"micro_batch_size": job.key[0], "done": sum(self.solved.values()), "total": len(self.jobs),
                           "incumbent_s": self.best.objective if self.best is not None else math.inf,
                           "bound_s": min(self.bounds.values()), "elapsed_s": time.perf_counter() - self.t0})
        if chosen is not None:
            self.offer(Solution(job.key[0], job.M, [int(back[k]) for k in chosen], obj, bound, status, job.cand),
                       job.key)

    def run(self) -> None:
        """Pass 1: every job briefly, most promising first (an early incumbent prunes the rest);
        pass 2: the jobs left unproven, with the remaining time."""
        if not self.brute:
            self.seed_incumbents()
        quick = self.opts.time_limit_s / (2 * max(1, len(self.jobs)))
        for job in self.jobs:
            self.attempt(job, min(quick, 2.0))
        for k, job in enumerate(self.jobs):
            if self.solved.get(job.key) or self.beaten(self.bounds[job.key]):
                continue
            left = self.opts.time_limit_s - (time.perf_counter() - self.t0)
            if left <= 0.2:
                break
            self.attempt(job, left / max(1, sum(1 for j in self.jobs[k:] if not self.solved.get(j.key))))

    def stats(self) -> dict:
        gap = max(0.0, (self.best.objective - min(self.bounds.values())) / self.best.objective)
        return {"seconds": time.perf_counter() - self.t0, "micro_batch_sizes": self.sizes,
                "candidates": sum(len(j.cand) for j in self.jobs), "units": self.U, "milp_variables": self.milp_vars,
                "gap": gap, "status": "optimal" if gap <= OPTIMAL_GAP else "feasible",
                "alternatives": sorted(self.pool.values(), key=lambda s: s.objective)}


def search(cm: CostModel, global_batch: int, opts: PlannerOptions = PlannerOptions(),
           progress: Optional[Callable[[dict], None]] = None) -> tuple[Solution, dict]:
    """Best solution over micro-batch sizes; also returns search statistics (``alternatives``: the best
    chain of every micro-batch size, for the simulator to choose among).

    ``progress``, if given, is called after every MILP with the search's state (micro-batch size just
    solved, sizes done/total, incumbent and lower bound in seconds, elapsed seconds): a live status.

    Micro-batch sizes are visited in order of their lower bound M * T_lb (T_lb: the smallest
    bottleneck any chain fitting the device total can have); a size whose bound cannot beat the
    incumbent is skipped, and candidates costing more than incumbent / M are dropped before the MILP
    (no stage of a better plan can cost more). Both cuts are exact.
    """
    if global_batch < 1:
        raise InputError("global_batch", f"must be >= 1, got {global_batch}")
    if opts.schedule not in SCHEDULES or schedule_kind(opts.schedule).chunked:  # chunks are cut after the MILP
        one_chunk = ", ".join(s for s in SCHEDULES if not schedule_kind(s).chunked)
        raise InputError("PlannerOptions.schedule", f"search() plans one of {one_chunk}, got "
                                       f"{opts.schedule!r} (the MILP plans one chunk per group)"[:160])
    if opts.equal_widths:  # what Megatron-core can run: one width, (here) no tensor parallelism, no per-stage ZeRO
        opts = replace(opts, max_tensor_parallel=1, zero1_stages=False)
    if _layer_granular_shapes(cm, opts):
        types = list(opts.device_types or cm.cluster.type_names)
        counts_all = cm.cluster.count_by_type()
        for t in types:
            if t not in counts_all:
                raise InputError("device_types", f"cluster {cm.cluster.name!r} has no {t!r} devices")
        counts = [counts_all[t] for t in types]
        sizes = micro_batch_sizes(global_batch, opts)
        shape = ShapeSearch(cm, global_batch, opts, progress, types, counts, sizes)
        shape.run()
        if shape.best is None and shape.ran_out():
            raise InfeasibleError("PlannerOptions.time_limit_s", f"no plan found within {opts.time_limit_s:g} s (some "
                                                                 f"micro-batch sizes were not searched to the end); "
                                                                 f"raise it")
        if shape.best is None:
            raise _infeasible(cm, global_batch, types, counts, sizes)
        return shape.best, shape.stats()
    warm = None
    types = opts.device_types or cm.cluster.type_names
    can_split = any(len(tensor_parallel_degrees(cm, t, opts.max_tensor_parallel)) > 1 for t in types)
    if can_split and cm.cluster.num_devices > 16 and opts.solver != "brute-force":
        # Tensor-parallel candidates multiply the space; the plain space first (half the time) gives an
        # incumbent, so the full search only looks below it and is never worse than no tensor parallelism.
        t0 = time.perf_counter()
        try:
            warm = _Search(cm, global_batch, replace(opts, max_tensor_parallel=1, time_limit_s=opts.time_limit_s / 2),
                           progress)
            warm.run()
        except InfeasibleError:
            warm = None
        opts = replace(opts, time_limit_s=max(opts.time_limit_s - (time.perf_counter() - t0), 1.0))
    s = _Search(cm, global_batch, opts, progress)
    if warm is not None and warm.best is not None:
        s.best = warm.best
        s.pool.update({("no-tp",) + k: v for k, v in warm.pool.items()})
    s.run()
    if s.best is None:
        raise _infeasible(cm, global_batch, s.types, s.counts, s.sizes)
    return s.best, s.stats()


def _layer_granular_shapes(cm: CostModel, opts: PlannerOptions) -> bool:
    """Plan a model of identical blocks at layer granularity with the shape MILP (``shapes``) unless the
    user asked for chunks (``max_units``), a fixed width or the brute-force reference."""
    n = cm.model.num_planner_layers
    types = list(opts.device_types or cm.cluster.type_names)
    return (opts.max_units is None and n > SHAPES_MIN_LAYERS and not opts.equal_widths
            and opts.solver != "brute-force" and identical_blocks(cm, types, opts.max_tensor_parallel))


def _infeasible(cm: CostModel, global_batch: int, types: list[str], counts: list[int], bs: list[int]):
    """One line saying which constraint fails and by how much."""
    if not bs:
        return InfeasibleError("global_batch", f"no micro-batch size divides {global_batch}")
    # memory: the whole model's state spread over every device, one layer each at best
    total_state = cm.state_bytes(0, cm.model.num_planner_layers)
    total_mem = sum(cm.memory_limit_bytes(t) * n for t, n in zip(types, counts))
    if total_state > total_mem:
        return InfeasibleError("memory", f"model {cm.model.name!r} needs {total_state / 2**30:.1f} GiB for weights, "
                                         f"gradients and optimizer state; the devices hold "
                                         f"{total_mem / 2**30:.1f} GiB after the reserve "
                                         f"(short by {(total_state - total_mem) / 2**30:.1f} GiB)")
    biggest = max(float(cm.state_bytes(l, l + 1) + cm.layers.act_bytes_recompute[l] + cm.layers.act_bytes[l])
                  for l in range(cm.model.num_planner_layers))
    largest_dev = max(cm.memory_limit_bytes(t) for t in types)
    if biggest > largest_dev:
        return InfeasibleError("memory", f"the largest layer needs {biggest / 2**30:.1f} GiB for one sample, the "
                                         f"largest device holds {largest_dev / 2**30:.1f} GiB after the reserve "
                                         f"(short by {(biggest - largest_dev) / 2**30:.1f} GiB); "
                                         f"a layer is never split (tensor parallelism splits a block's weights, "
                                         f"not the embedding, the head or a measured layer)")
    tie = (f"; its tied embedding/head weight is held by both end stages "
           f"({cm.state_bytes(0, 1) / 2**30:.1f} GiB of state on the first)" if cm.tied_params(0, 1) else "")
    return InfeasibleError("memory", f"no stage layout of {cm.model.name!r} fits the devices' memory at any "
                                     f"micro-batch size in {bs} (1F1B keeps up to one micro-batch per later stage "
                                     f"in flight{tie}); add devices or use a smaller global batch")


def solution_layouts(sol: Solution, units: list[tuple[int, int]], types: list[str]) -> list[StageLayout]:
    c = sol.cands
    units = sol.units or units
    out = []
    for k in sol.chosen:
        wb, sb = int(c.width2[k]), int(c.samples2[k])
        # a mixed stage: the first type's replicas share what the second's (s_b each) leave
        samples = even_split(sol.b - wb * sb, int(c.width[k])) + (sb,) * wb
        second = (types[c.type2_idx[k]],) * wb if wb else ()
        out.append(StageLayout(layers=(units[c.first_unit[k]][0], units[c.end_unit[k] - 1][1]),
                               device_type=types[c.type_idx[k]], samples=samples, recompute=bool(c.recompute[k]),
                               zero1=bool(c.zero1[k]),
                               tensor_parallel=max(int(c.tp[k]), int(c.tp2[k])),
                               replica_tp=((int(c.tp[k]),) * int(c.width[k]) + (int(c.tp2[k]),) * wb
                                           if wb and c.tp2[k] != c.tp[k] else ()),
                               replica_types=(types[c.type_idx[k]],) * int(c.width[k]) + second if wb else ()))
    return out
