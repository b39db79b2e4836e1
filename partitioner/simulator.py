"""Event-level replay of one iteration of a plan's schedule (``hethub simulate``).

Each rank executes its actions in order. Compute actions take the cost model's time for the rank's
rows. A transfer starts when both its sender's and its receiver's actions are posted and the links
are free: inter-node transfers hold the sending host's NIC (egress) and the receiving host's NIC
(ingress) — one resource per direction per node, shared by all its ranks; intra-node transfers
share nothing. An action's transfers are issued together; the action ends when all have ended. A
stage's all-reduce starts when its last replica reaches it. A schedule that cannot finish is a
deadlock, reported with the blocked ranks, their step and what they wait for.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Optional

from .costmodel import WIRE_FACTOR, CostModel
from .errors import InputError
from .records import Plan
from .schedule import Action, Transfer, build_schedule


class ScheduleError(InputError):
    """A schedule that cannot run: unmatched transfer or deadlock (names rank, step and reason)."""


@dataclass
class Event:
    rank: int
    name: str  # the action's text, e.g. "F3" or "SA3>r5[0:4]"
    kind: str
    mb: Optional[int]
    start_s: float
    end_s: float


@dataclass
class SimResult:
    iteration_s: float
    samples_per_s: float
    bubble_fraction: float  # mean over ranks of the time not spent in forward/backward compute
    busy: dict[int, float]  # per rank: compute time / iteration time
    events: list[Event] = field(default_factory=list)

    def chrome_trace(self, plan: Plan) -> dict:
        """Chrome trace-event JSON (Perfetto, chrome://tracing): one track per rank."""
        evs = []
        for st in plan.stages:
            for rep in st.replicas:
                evs.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": rep.rank,
                            "args": {"name": f"rank {rep.rank} stage {st.index} {st.device_type} {rep.host}"}})
        for e in self.events:
            evs.append({"name": e.name, "cat": e.kind, "ph": "X", "pid": 0, "tid": e.rank,
                        "ts": e.start_s * 1e6, "dur": max(0.0, (e.end_s - e.start_s) * 1e6),
                        "args": {"micro_batch": e.mb}})
        return {"traceEvents": evs, "displayTimeUnit": "ms"}


def check_matching(sched: dict[int, list[Action]]) -> None:
    """Each send has exactly one matching receive (same micro-batch, rows and peers) and vice versa."""
    pairs = {"SA": "RA", "SG": "RG"}
    sends: dict[tuple, tuple[int, int]] = {}
    recvs: dict[tuple, tuple[int, int]] = {}
    for rank, acts in sched.items():
        for step, a in enumerate(acts):
            for t in a.transfers:
                if a.kind in pairs:
                    key = (pairs[a.kind], a.mb, rank, t.peer, t.start, t.stop)
                    if key in sends:
                        raise ScheduleError(f"rank {rank} step {step}", f"{a} sends rows {t.start}:{t.stop} of "
                                                                        f"micro-batch {a.mb} to rank {t.peer} twice")
                    sends[key] = (rank, step)
                else:
                    key = (a.kind, a.mb, t.peer, rank, t.start, t.stop)
                    if key in recvs:
                        raise ScheduleError(f"rank {rank} step {step}", f"{a} receives the same rows twice")
                    recvs[key] = (rank, step)
    for key, (rank, step) in sends.items():
        if key not in recvs:
            raise ScheduleError(f"rank {rank} step {step}", f"send of micro-batch {key[1]} rows {key[4]}:{key[5]} "
                                                            f"to rank {key[3]} has no matching receive")
    for key, (rank, step) in recvs.items():
        if key not in sends:
            raise ScheduleError(f"rank {rank} step {step}", f"receive of micro-batch {key[1]} rows {key[4]}:{key[5]} "
                                                            f"from rank {key[2]} has no matching send")


def simulate(plan: Plan, cm: CostModel, sched: Optional[dict[int, list[Action]]] = None) -> SimResult:
    sched = sched if sched is not None else build_schedule(plan)
    if set(sched) != set(range(plan.world_size)):
        raise ScheduleError("schedule", f"must hold ranks 0..{plan.world_size - 1}, got {sorted(sched)}")
    check_matching(sched)
    where = {r.rank: (st, r) for st in plan.stages for r in st.replicas}
    n = plan.world_size
    pc = [0] * n
    clock = [0.0] * n
    posted: dict[int, float] = {}  # rank -> time its current action was posted
    done_transfers: dict[tuple, float] = {}  # (sender, receiver, kind, mb, start) -> end time
    nic_out: dict[str, float] = {}
    nic_in: dict[str, float] = {}
    compute = [0.0] * n
    events: list[Event] = []

    def duration(rank: int, a: Action) -> float:
        st, rep = where[rank]
        first, last = st.layers
        if a.kind == "F":
            return cm.stage_compute_s(st.device_type, first, last, rep.samples, st.recompute)[0]
        if a.kind == "B":
            return cm.stage_compute_s(st.device_type, first, last, rep.samples, st.recompute)[1]
        if a.kind == "OPT":
            return cm.optimizer_s(st.device_type, first, last, st.width)
        return 0.0  # L: the loader is not modelled

    def transfer_key(rank: int, a: Action, t: Transfer) -> tuple:
        if a.kind in ("SA", "SG"):
            return (rank, t.peer, a.kind[1], a.mb, t.start)
        return (t.peer, rank, a.kind[1], a.mb, t.start)

    def peer_posted(rank: int, a: Action, t: Transfer) -> bool:
        """The peer's current action is the matching half of this transfer and has been posted."""
        p = t.peer
        if p not in posted or pc[p] >= len(sched[p]):
            return False
        b = sched[p][pc[p]]
        want = {"SA": "RA", "RA": "SA", "SG": "RG", "RG": "SG"}[a.kind]
        return b.kind == want and b.mb == a.mb and any(u.peer == rank and u.start == t.start for u in b.transfers)

    def run_transfer(rank: int, a: Action, t: Transfer) -> None:
        key = transfer_key(rank, a, t)
        if key in done_transfers:
            return
        src, dst = key[0], key[1]
        (sst, srep), (dst_st, drep) = where[src], where[dst]
        layer = sst.layers[1] - 1
        bd = plan.boundary(sst.index)
        nbytes = (t.stop - t.start) * float(cm.layers.out_bytes[layer]) * WIRE_FACTOR[bd.dtype if bd else None]
        same = srep.host == drep.host
        dur = cm.p2p_s(nbytes, sst.device_type, dst_st.device_type, same)
        start = max(posted[src], posted[dst])
        if not same:
            start = max(start, nic_out.get(srep.host, 0.0), nic_in.get(drep.host, 0.0))
            nic_out[srep.host] = nic_in[drep.host] = start + dur
        done_transfers[key] = start + dur
        events.append(Event(src, f"{a.kind[1]}{a.mb}>r{dst}", "transfer", a.mb, start, start + dur))

    stage_of = {r: where[r][0].index for r in range(n)}
    progress = True
    while progress:
        progress = False
        for r in range(n):
            while pc[r] < len(sched[r]):
                a = sched[r][pc[r]]
                if a.kind in ("L", "F", "B", "OPT"):
                    d = duration(r, a)
                    events.append(Event(r, str(a), a.kind, a.mb, clock[r], clock[r] + d))
                    if a.kind in ("F", "B"):
                        compute[r] += d
                    clock[r] += d
                    pc[r] += 1
                    progress = True
                    continue
                posted.setdefault(r, clock[r])
                if a.kind == "AR":
                    group = [rep.rank for rep in where[r][0].replicas]
                    ready = all(q in posted and pc[q] < len(sched[q]) and sched[q][pc[q]].kind == "AR"
                                for q in group)
                    if not ready:
                        break
                    st = where[r][0]
                    start = max(posted[q] for q in group)
                    end = start + cm.allreduce_s(cm.grad_bytes(*st.layers), st.device_type, st.width,
                                                 len({rep.host for rep in st.replicas}) == 1)
                    for q in group:
                        events.append(Event(q, "AR", "allreduce", None, start, end))
                        clock[q] = end
                        pc[q] += 1
                        posted.pop(q, None)
                    progress = True
                    if pc[r] >= len(sched[r]) or r not in group:
                        break
                    continue
                for t in a.transfers:
                    if transfer_key(r, a, t) not in done_transfers and peer_posted(r, a, t):
                        run_transfer(r, a, t)
                if all(transfer_key(r, a, t) in done_transfers for t in a.transfers):
                    clock[r] = max([clock[r]] + [done_transfers[transfer_key(r, a, t)] for t in a.transfers])
                    pc[r] += 1
                    posted.pop(r, None)
                    progress = True
                    continue
                break
    stuck = [r for r in range(n) if pc[r] < len(sched[r])]
    if stuck:
        r = stuck[0]
        a = sched[r][pc[r]]
        waits = ", ".join(f"rank {t.peer}" for t in a.transfers) or f"stage {stage_of[r]}'s replicas"
        others = "; ".join(f"rank {q} at step {pc[q]} ({sched[q][pc[q]]})" for q in stuck[1:4])
        raise ScheduleError(f"rank {r} step {pc[r]}", f"deadlock: {a} waits for {waits}"
                                                      + (f"; also blocked: {others}" if others else ""))
    it = max(clock)
    busy = {r: compute[r] / it for r in range(n)}
    return SimResult(iteration_s=it, samples_per_s=plan.global_batch_size / it,
                     bubble_fraction=1.0 - sum(busy.values()) / n, busy=busy, events=events)


def write_trace(result: SimResult, plan: Plan, path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(result.chrome_trace(plan), f)


def write_png(result: SimResult, plan: Plan, path: str, title: str = "") -> None:
    """Timeline: one row per rank, colour per micro-batch; forward solid, backward hatched, transfers thin."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    n = plan.world_size
    fig, ax = plt.subplots(figsize=(12, 0.45 * n + 1.6))
    # tab20 without its two greys, which read as transfers / all-reduce
    palette = [c for k, c in enumerate(plt.get_cmap("tab20").colors) if k not in (14, 15)]
    cmap = lambda mb: palette[mb % len(palette)]  # noqa: E731
    scale = 1e3  # ms
    for e in result.events:
        y = n - 1 - e.rank
        x, w = e.start_s * scale, max((e.end_s - e.start_s) * scale, 0.0)
        if e.kind in ("F", "B"):
            ax.broken_barh([(x, w)], (y - 0.4, 0.8), facecolors=cmap(e.mb), edgecolor="black", linewidth=0.3,
                           hatch="///" if e.kind == "B" else None, alpha=1.0 if e.kind == "F" else 0.75)
        elif e.kind == "transfer":
            ax.broken_barh([(x, w)], (y - 0.45, 0.12), facecolors="dimgray")
        elif e.kind in ("allreduce", "OPT"):
            ax.broken_barh([(x, w)], (y - 0.4, 0.8), facecolors="lightgray" if e.kind == "allreduce" else "black")
    labels = []
    for r in range(n - 1, -1, -1):
        s, _ = plan.locate(r)
        labels.append(f"r{r} s{s} {plan.stages[s].device_type}")
    ax.set_yticks(range(n))
    ax.set_yticklabels(labels, fontsize=8)
    ax.set_xlabel("ms")
    ax.set_title(title or f"{plan.model.name}: {plan.num_stages} stages, {n} ranks, "
                          f"{result.iteration_s * 1e3:.1f} ms/iteration, bubble {result.bubble_fraction:.1%}")
    ax.legend(handles=[Patch(facecolor="white", edgecolor="black", label="forward"),
                       Patch(facecolor="white", edgecolor="black", hatch="///", label="backward"),
                       Patch(facecolor="dimgray", label="transfer"), Patch(facecolor="lightgray", label="all-reduce"),
                       Patch(facecolor="black", label="optimizer")], loc="upper right", fontsize=7, ncol=5)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
