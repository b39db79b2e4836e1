"""Elastic start: the ranks that are present agree on who they are, rank 0 plans for them, every rank runs that plan.

Why at ``initialize``, from the ranks themselves: a restart after a host is lost (or joins) brings up whichever
workers the elastic agent started, numbered by its rendezvous, not by the plan. Every worker knows its host (the
launcher sets ``HETHUB_HOST``) and its slot on it (``LOCAL_RANK``). They gather those over the control channel,
rank 0 keeps the plan's cluster to the hosts present (each with as many devices as it has workers), plans for that
with the same model, global batch and dtype (only speed changes, never the optimisation), numbers the plan's
replicas by the agent's ranks, records it as ``DIR/plans/step-<k>.json`` (k: the step the job resumes from) and
sends it to every rank. A sub-cluster that cannot hold the model ends every rank with one line (exit 2).

The checkpoint every restart resumes from is the newest complete one in DIR (written every N steps by the engine
itself: ``checkpoint_every``), so the steps lost to a failure are at most N.
"""
from __future__ import annotations

import json
import os
import time
from typing import Optional, Sequence

from ..events import EVENTS_ENV, plan_files, say
from ..partitioner.api import make_plan
from ..partitioner.costmodel import CostModel
from ..partitioner.errors import InputError
from ..partitioner.outputs import write_atomic
from ..partitioner.options import NETWORKS
from ..partitioner.planner import PlannerOptions
from ..partitioner.records import Cluster, Plan, parse_record
from .checkpoint import complete_checkpoints, read_meta
from .control import Control
from ..partitioner.schedule_kinds import kind as schedule_kind

HOST_ENV = "HETHUB_HOST"  # this worker's host, as the plan's cluster names it (set by ``hethub launch --elastic``)
REPLAN_TIME_LIMIT_S = 2.0  # the planner's budget at a restart: a 16-device cluster is proven optimal well within it
HOST_BYTES = 255  # a host name, as the cluster file allows it


def this_host(plan: Plan) -> str:
    """The plan's host this worker runs on (``HETHUB_HOST``), checked against the plan's cluster."""
    host = os.environ.get(HOST_ENV, "")
    hosts = plan.cluster.hosts
    if host not in hosts:
        raise InputError(HOST_ENV, f"{host[:80]!r} is not a host of the plan's cluster ({', '.join(hosts)[:200]}): "
                                   "hethub launch --elastic sets it on each host")
    return host


def resume_step(checkpoint_dir: str) -> int:
    """The step of the newest complete checkpoint in ``checkpoint_dir`` (0 if none)."""
    tags = complete_checkpoints(checkpoint_dir)
    return read_meta(os.path.join(checkpoint_dir, tags[-1]))["global_steps"] if tags else 0


def present(control: Control, host: str, local_rank: int) -> list[tuple[str, int]]:
    """(host, local rank) of every rank of the world, in rank order."""
    data = host.encode()[:HOST_BYTES]
    rows = control.all_gather([local_rank, len(data), *data, *([0] * (HOST_BYTES - len(data)))])
    return [(bytes(r[2:2 + r[1]]).decode(), r[0]) for r in rows]


def sub_cluster(cluster: Cluster, ranks: Sequence[tuple[str, int]]) -> Cluster:
    """The cluster kept to the hosts present, each with as many devices as it has workers (in file order)."""
    counts: dict[str, int] = {}
    for host, _ in ranks:
        counts[host] = counts.get(host, 0) + 1
    data = cluster.model_dump(exclude_none=True)  # validated anew: a copy would keep the whole cluster's caches
    nodes = []
    for n in data["nodes"]:  # a host with several device types: its workers fill its entries in file order
        take = min(n["count"], counts.get(n["host"], 0))
        if take:
            nodes.append({**n, "count": take})
            counts[n["host"]] -= take
    data["nodes"] = nodes
    return parse_record(Cluster, data, "elastic cluster")


def renumber(plan: Plan, ranks: Sequence[tuple[str, int]]) -> Plan:
    """``plan`` with each device's rank the agent's rank of the worker on that (host, slot)."""
    rank_of = {where: r for r, where in enumerate(ranks)}
    data = plan.model_dump(exclude_none=True)
    for st in data["stages"]:
        for rep in st["replicas"]:
            if "slots" in rep:
                rep["ranks"] = [rank_of[(rep["host"], s)] for s in rep["slots"]]
            else:
                rep["rank"] = rank_of[(rep["host"], rep["slot"])]
    return parse_record(Plan, data, "elastic plan")


def replan(base: Plan, cluster: Cluster) -> Plan:
    """The best plan for ``cluster`` with ``base``'s model, global batch, dtype, schedule and network model (a
    chunked schedule's groups are planned as 1F1B's; ``hethub plan --schedule`` re-cuts them), tensor parallel no
    wider than the base plan's (the user's layers may split no further)."""
    cm = CostModel(cluster, base.model, dtype=base.dtype or "bf16", zero1=base.zero1)
    schedule = schedule_kind(base.schedule).milp  # a chunked one is planned for its groups (1F1B), as api.solve does
    network = getattr(base.solver, "network", None) or "overlap"  # plans written before it was recorded: overlap
    if network not in NETWORKS:
        raise InputError("plan.solver.network", f"expected one of {', '.join(NETWORKS)}, got {str(network)[:40]!r}")
    opts = PlannerOptions(time_limit_s=REPLAN_TIME_LIMIT_S, schedule=schedule,
                          max_tensor_parallel=max(st.tensor_parallel for st in base.stages), network=network)
    return make_plan(cluster, base.model, base.global_batch_size, opts=opts, with_homogeneous_sum=False, cost_model=cm)


def same_devices(plan: Plan, cluster: Cluster) -> bool:
    """Whether ``plan`` was made for exactly these hosts and counts."""
    return [(n.host, n.device_type, n.count) for n in plan.cluster.nodes] == [(n.host, n.device_type, n.count)
                                                                             for n in cluster.nodes]


def elastic_plan(base: Plan, control: Control, checkpoint_dir: str) -> Plan:
    """Collective over the world: the plan this start runs (``base`` itself while every host of its cluster is
    present with all its devices, else a re-plan), numbered by the world's ranks, recorded and on every rank."""
    host = this_host(base)
    ranks = present(control, host, int(os.environ.get("LOCAL_RANK", "0")))
    text, error = "", ""
    if control.rank == 0:
        try:
            text, error = _plan_text(base, ranks, checkpoint_dir), ""
        except InputError as exc:
            error = str(exc)
    error = control.broadcast_text(error)
    if error:
        raise InputError("elastic", error)
    return parse_record(Plan, json.loads(control.broadcast_text(text)), "elastic plan")


def _plan_text(base: Plan, ranks: Sequence[tuple[str, int]], checkpoint_dir: str) -> str:
    """Rank 0: plan for the workers present, record it, say what changed; the plan as JSON."""
    cluster = sub_cluster(base.cluster, ranks)
    step = resume_step(checkpoint_dir)
    t0 = time.perf_counter()
    replanned = not same_devices(base, cluster)
    plan = replan(base, cluster) if replanned else base
    planned_s = time.perf_counter() - t0 if replanned else None
    if plan.world_size != len(ranks):
        raise InputError("elastic", f"the plan for the hosts present uses {plan.world_size} of their {len(ranks)} "
                                    "devices; an elastic run needs every present device in its plan (a host with "
                                    "devices to spare: list fewer in the cluster)")
    plan = renumber(plan, ranks)
    plans = os.path.join(checkpoint_dir, "plans")
    os.makedirs(plans, exist_ok=True)
    before = _previous_plan(checkpoint_dir, step)
    write_atomic(os.path.join(plans, f"step-{step}.json"), plan.to_json(), "plan")
    _say(base, before, plan, cluster, step, planned_s)
    return plan.to_json()


def _previous_plan(checkpoint_dir: str, step: int) -> Optional[Plan]:
    """The plan the job ran under before this start (the newest ``step-<k>.json`` with k <= step), if any."""
    for _k, path in reversed([(k, p) for k, p in plan_files(checkpoint_dir) if k <= step]):
        try:
            with open(path, encoding="utf-8") as f:
                return parse_record(Plan, json.loads(f.read()), os.path.basename(path))
        except (OSError, ValueError, InputError):
            continue  # not one this hethub wrote: an older one says what ran before
    return None


def _hosts(plan: Plan) -> dict[str, int]:
    return {h: plan.cluster.host_count(h) for h in plan.cluster.hosts}


def _say(base: Plan, before: Optional[Plan], plan: Plan, cluster: Cluster, step: int,
         planned_s: Optional[float]) -> None:
    """One line on stderr (and ``--log-json``): which hosts were lost or joined since the plan before, which are
    missing from the job's cluster, the step, the plan's shape and predicted samples/s, the planning time."""
    have = _hosts(plan)
    had = _hosts(before) if before is not None else have
    lost, joined = [h for h in had if h not in have], [h for h in have if h not in had]
    full = _hosts(base)
    missing = [h for h in full if h not in have]
    fewer = [f"{h} ({have[h]}/{n})" for h, n in full.items() if 0 < have.get(h, 0) < n]
    shape = " | ".join(f"{st.device_type} x{st.width} [{st.chunk_ranges[0][0]},{st.chunk_ranges[-1][1]})"
                       for st in plan.stages)
    rate = plan.predicted.samples_per_s if plan.predicted else float("nan")
    change = "".join([f"lost {', '.join(lost)}; " if lost else "", f"joined {', '.join(joined)}; " if joined else ""])
    who = (f"hosts missing: {', '.join(missing)}" if missing else "every host present") + (
        f"; with fewer devices: {', '.join(fewer)}" if fewer else "")
    planned = f"planned in {planned_s:.2f} s" if planned_s is not None else "the job's own plan"
    say(f"step {step}: {change}{who}; plan {shape}, {rate:.3g} samples/s predicted ({planned})",
        os.environ.get(EVENTS_ENV, ""), "plan", step=step, lost=lost, joined=joined, missing=missing,
        stages=[[st.device_type, st.width, st.chunk_ranges[0][0], st.chunk_ranges[-1][1]] for st in plan.stages],
        samples_per_s=rate, replan_s=None if planned_s is None else round(planned_s, 3))


def newest_checkpoint(checkpoint_dir: str) -> Optional[str]:
    """The newest complete checkpoint's tag in ``checkpoint_dir``, if any."""
    tags = complete_checkpoints(checkpoint_dir)
    return tags[-1] if tags else None


class Heartbeat:
    """Rank 0's last finished step and its time (``DIR/plans/.heartbeat``), rewritten after every step: a restart
    reads it to say how long the job stood still, from the last step before the change to its first step after."""

    def __init__(self, checkpoint_dir: str):
        self.path = os.path.join(checkpoint_dir, "plans", ".heartbeat")
        self.before = self._read()  # the previous run's last step, if there was one
        self.said = False

    def _read(self) -> Optional[tuple[int, float]]:
        try:
            with open(self.path, encoding="utf-8") as f:
                beat = json.load(f)
            return int(beat["step"]), float(beat["t"])
        except (OSError, ValueError, KeyError, TypeError):  # none yet, or not one this hethub wrote: nothing to say
            return None

    def beat(self, step: int) -> None:
        now = time.time()
        write_atomic(self.path, json.dumps({"step": step, "t": now}), "heartbeat")
        if self.before is not None and not self.said:
            last, t = self.before
            say(f"first step under this plan (step {step}) {now - t:.1f} s after the last step before the restart "
                f"(step {last})", os.environ.get(EVENTS_ENV, ""), "first_step", step=step, last_step=last,
                stood_still_s=round(now - t, 3))
            self.said = True
