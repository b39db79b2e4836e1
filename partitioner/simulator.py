"""Event-level replay of one iteration of a plan's schedule (``hethub simulate``).

The replay follows the runtime's semantics (``schedule`` module docstring): posting a send or a
receive takes no time and never blocks; a transfer starts once both its send and its receive are
posted, every operation either rank posted before it on the same group has finished (NCCL runs a
group's operations in issue order, one at a time; so does the runtime's ordered transport on gloo)
and its links are free, and takes the cost model's p2p time; a send waits (blocking its rank) while
its peer has ``SEND_WINDOW`` unfinished sends from the rank; a forward (backward) starts once
the rank is free and every transfer of its activations (gradients) has arrived. Inter-node transfers
hold the sending host's NIC (egress) and the receiving host's NIC (ingress) — one resource per
direction per node, shared by all its ranks, booked by transfers in the order they are posted (the rank with the
earliest clock steps next); intra-node transfers share nothing. A stage's all-reduce
starts when its last replica reaches it. The iteration ends when every rank has finished and every
transfer has landed. A schedule that cannot finish is a deadlock, reported with the blocked ranks,
their step and what they wait for.
"""
from __future__ import annotations

import bisect
import heapq
import json
import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

from .costmodel import CostModel, allreduce_end_s, pass_times_s, whole_state
from .errors import InputError, missing_package
from .groups import SEND_WINDOW, transfer_group
from .ordering import MispairedError, OrderError, check_order, vstage
from .outputs import count, write_atomic
from .records import Plan
from .schedule import Action, Transfer, build_schedule, lead_ranks
from .schedule_kinds import kind as schedule_kind


class ScheduleError(InputError):
    """A schedule that cannot run: unmatched transfer or deadlock (names rank, step and reason)."""


class OutOfTime(RuntimeError):
    """A replay given a ``deadline`` did not finish by it: the planner, choosing among plans, keeps to its time
    limit (a 768-device replay takes 0.5-3 s, and its length is hard to tell before it runs)."""


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
                            "args": {"name": f"rank {rep.rank} stage {st.index} {st.type_of(rep)} {rep.host}"}})
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
            # the boundary crossed (after chunk b), in a chunked plan: two chunks' transfers between the same ranks
            b = None if a.chunk is None else a.chunk - (a.kind in ("RA", "SG"))
            for t in a.transfers:
                if a.kind in pairs:
                    key = (pairs[a.kind], a.mb, b, rank, t.peer, t.start, t.stop)
                    if key in sends:
                        raise ScheduleError(f"rank {rank} step {step}", f"{a} sends rows {t.start}:{t.stop} of "
                                                                        f"micro-batch {a.mb} to rank {t.peer} twice")
                    sends[key] = (rank, step)
                else:
                    key = (a.kind, a.mb, b, t.peer, rank, t.start, t.stop)
                    if key in recvs:
                        raise ScheduleError(f"rank {rank} step {step}", f"{a} receives the same rows twice")
                    recvs[key] = (rank, step)
    for key, (rank, step) in sends.items():
        if key not in recvs:
            raise ScheduleError(f"rank {rank} step {step}", f"send of micro-batch {key[1]} rows {key[5]}:{key[6]} "
                                                            f"to rank {key[4]} has no matching receive")
    for key, (rank, step) in recvs.items():
        if key not in sends:
            raise ScheduleError(f"rank {rank} step {step}", f"receive of micro-batch {key[1]} rows {key[5]}:{key[6]} "
                                                            f"from rank {key[3]} has no matching send")


_NEEDS = {"F": [("RA", "not first"), ("L", "ends")], "B": [("F", "always"), ("RG", "not last")],
          "SA": [("F", "not last")], "RG": [("F", "not last")], "SG": [("B", "not first")], "RA": [], "L": [],
          "OPT": [("AR", "train")], "AR": [], "W": [("B", "always")]}  # what must come earlier on the rank


def check_structure(plan: Plan, sched: dict[int, list[Action]], train: bool = True) -> None:
    """What the runtime needs of each rank's list: every micro-batch's forward (and backward) once per chunk the
    rank holds and in order of dependence, each fed by exactly one receive of this rank's rows, posted before it."""
    M = plan.num_micro_batches
    chunked = plan.num_chunks > 1 or schedule_kind(plan.schedule).chunked
    for rank, acts in sched.items():
        s, j = plan.locate(rank)
        mine = plan.chunks_of_group[s]
        rows = plan.stages[s].sample_ranges()[j]  # once per rank: a stage may be 65,536 wide
        seen: dict[tuple, int] = {}
        for step, act in enumerate(acts):
            _check_action(plan, rank, step, act, seen, chunked, train, mine, rows)
        if not train and any(act.kind == "W" for act in acts):
            raise ScheduleError(f"rank {rank}", "an evaluation schedule has no W (weight-gradient) actions")
        ar = seen.get(("AR", None, None))
        late = [key for key, step in seen.items() if key[0] == "W" and ar is not None and step > ar]
        if late:
            raise ScheduleError(f"rank {rank} step {seen[late[0]]}",
                                f"W{late[0][1]} comes after AR: weight gradients must be complete before the all-reduce")
        for chunk in (mine if chunked else (None,)):
            split = any(key[0] == "W" and key[2] == chunk for key in seen)
            for kind in ["F"] + (["B"] if train else []) + (["W"] if split else []):
                missing = [mb for mb in range(M) if (kind, mb, chunk) not in seen]
                if missing:
                    at = "" if chunk is None else f"@{chunk}"
                    raise ScheduleError(f"rank {rank}", f"no {kind}{missing[0]}{at} (every micro-batch 0..{M - 1} "
                                                        "needs one)")


def _check_action(plan: Plan, rank: int, step: int, act: Action, seen: dict, chunked: bool, train: bool,
                  mine: tuple, rows: tuple[int, int]) -> None:
    """One action of a rank's list against what came before it (``seen``: (kind, mb, chunk) -> step); ``mine``:
    the chunks the rank holds, ``rows``: its rows of a micro-batch."""
    M, V = plan.num_micro_batches, len(plan.pipeline)
    a, b = rows
    where, unit = f"rank {rank} step {step}", "chunk" if chunked else "stage"
    if chunked and act.kind not in ("L", "AR", "OPT") and act.chunk not in mine:
        raise ScheduleError(where, f"{act}: rank {rank} holds chunks {', '.join(map(str, mine))}"
                                   + ("" if act.chunk is not None else " (name one: F3@5)"))
    if not chunked and act.chunk is not None:
        raise ScheduleError(where, f"{act}: the plan's groups hold one chunk each; actions name none")
    k = vstage(plan, rank, act) if act.kind not in ("L", "AR", "OPT") else None
    first, last = k == 0, k == V - 1
    key = (act.kind, act.mb, act.chunk)
    if key in seen:
        raise ScheduleError(where, f"{act} repeats step {seen[key]}")
    seen[key] = step
    if act.mb is not None and not 0 <= act.mb < M:
        raise ScheduleError(where, f"{act}: micro-batch {act.mb} is outside 0..{M - 1}")
    when = {"always": True, "not first": not first, "not last": not last, "ends": first or last, "train": train}
    for before, rule in _NEEDS[act.kind]:
        chunk = None if before in ("L", "AR") else act.chunk
        if when[rule] and (before, act.mb, chunk) not in seen:
            at = "" if chunk is None else f"@{chunk}"
            raise ScheduleError(where, f"{act} needs {before}{'' if act.mb is None else act.mb}{at} earlier on this rank")
    if act.kind == "L" and not (0 in mine or V - 1 in mine):
        raise ScheduleError(where, f"{act}: rank {rank} holds neither the first nor the last layers")
    if act.kind in ("SA", "RG") and last or act.kind in ("RA", "SG") and first:
        raise ScheduleError(where, f"{act}: {unit} {k} has no {'next' if last else 'previous'} {unit}")
    if act.kind == "RA":
        rows = sorted((t.start, t.stop) for t in act.transfers)
        if rows[0][0] != a or rows[-1][1] != b or any(p[1] != q[0] for p, q in zip(rows, rows[1:])):
            raise ScheduleError(where, f"{act} must receive exactly this rank's rows {a}:{b}")
    if any(not (a <= t.start < t.stop <= b) for t in act.transfers if act.kind in ("SA", "SG")):
        raise ScheduleError(where, f"{act} sends rows outside this rank's {a}:{b}")
    if act.kind == "W" and k == 0:
        raise ScheduleError(f"rank {rank}", f"{unit} 0 has no input gradients to split from its weights': its B "
                                            "runs the whole backward, with no W")


def _short_ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks[:12])) + (" ..." if len(ranks) > 12 else "")


def simulate(plan: Plan, cm: CostModel, sched: Optional[dict[int, list[Action]]] = None,
             train: bool = True, deadline: Optional[float] = None) -> SimResult:
    """Replay one iteration of ``sched`` (default: the plan's own schedule, which needs no checks); a given
    schedule is checked first (matching transfers, structure), and a deadlock raises ``ScheduleError``, one under
    NCCL's issue order ``ordering.OrderError``. ``deadline`` (``time.perf_counter()``, the plan's own schedule):
    past it the replay stops with ``OutOfTime``."""
    if sched is None:
        return _Replay(plan, cm, build_schedule(plan, train), train).run(deadline)
    leads = lead_ranks(plan)
    if set(sched) != set(leads):
        raise ScheduleError("schedule", f"must hold every replica's rank {_short_ranks(leads)} (a tensor-"
                                        f"parallel group's lead), got {_short_ranks(sorted(sched))}")
    check_matching(sched)
    check_structure(plan, sched, train)
    try:
        result = _Replay(plan, cm, sched, train).run()
    except ScheduleError:
        _refuse_mispaired(plan, sched)  # the exact reason where one exists: messages NCCL would mis-pair
        raise
    check_order(plan, sched)  # a deadlock the timed replay's order does not meet (the plan's own pass)
    return result


def _refuse_mispaired(plan: Plan, sched: dict[int, list[Action]]) -> None:
    try:
        check_order(plan, sched)
    except MispairedError:
        raise
    except OrderError:
        return  # a plain deadlock: the timed replay's own message names what each rank waits for


def _first_gap(busy: list[tuple[float, float]], t: float, dur: float) -> float:
    """Earliest start >= t of a free interval of length dur among sorted, non-overlapping busy intervals."""
    k = max(0, bisect.bisect_right(busy, (t, math.inf)) - 1)
    while k < len(busy):
        s, e = busy[k]
        if e <= t:
            k += 1
            continue
        if t + dur <= s:
            break
        t = max(t, e)
        k += 1
    return t


class _Replay:
    """The replay's state: per rank a program counter and clock; per transfer its posting and end times."""

    def __init__(self, plan: Plan, cm: CostModel, sched: dict[int, list[Action]], train: bool):
        self.plan, self.cm, self.sched, self.train = plan, cm, sched, train
        self.where = {r.rank: (st, r) for st in plan.stages for r in st.replicas}
        n = plan.world_size
        self.pc, self.clock, self.compute = [0] * n, [0.0] * n, [0.0] * n
        self.send_post: dict[tuple, float] = {}  # transfer key -> time its send was posted
        self.recv_post: dict[tuple, float] = {}
        self.done: dict[tuple, float] = {}  # transfer key -> time its data arrived
        self.recv_keys: dict[tuple, list[tuple]] = {}  # (rank, "A"|"G", mb) -> keys of that receive
        # (rank, group) -> its transfers not yet finished, in posting order; and when its last one finished
        self.lanes: dict[tuple, deque] = {}
        self.lane_free: dict[tuple, float] = {}
        self.key_lanes: dict[tuple, tuple[tuple, tuple]] = {}  # transfer key -> (sender's lane, receiver's lane)
        self.key_stop: dict[tuple, int] = {}
        self.held: dict[tuple, list[tuple]] = {}  # (rank, "SA"|"SG", peer) -> its unfinished sends, oldest first
        self.nic_out: dict[str, list[tuple[float, float]]] = {}  # host -> sorted busy intervals
        self.nic_in: dict[str, list[tuple[float, float]]] = {}
        self.ar_waiting: dict[int, dict[int, float]] = {}  # stage -> {rank: time it reached its AR}
        self.last_grad: dict[int, tuple[float, float]] = {}  # rank -> (end, seconds) of its last gradient pass
        # micro-batches whose weight gradients run as their own W: their B accumulates none
        self.split_mbs = {r: {(a.mb, a.chunk) for a in acts if a.kind == "W"} for r, acts in sched.items()}
        self.events: list[Event] = []
        self.woken: list[int] = []  # ranks a booked transfer or a finished all-reduce may have released
        self.durations: dict[int, dict[str, float]] = {}
        self.transfer_cache: dict[tuple, tuple[float, bool]] = {}
        # per rank, the (kind, mb, chunk) its forwards/backwards wait for: activations or gradients it receives
        self.receives = {r: {(a.kind[1], a.mb, a.chunk) for a in acts if a.kind in ("RA", "RG")}
                         for r, acts in sched.items()}

    def key(self, rank: int, a: Action, t: Transfer) -> tuple:
        """(sender, receiver, "A"|"G", micro-batch, boundary, first row): both halves of a transfer share it (the
        boundary, after chunk b of the pipeline, tells a chunked plan's transfers between the same ranks apart)."""
        b = vstage(self.plan, rank, a) - (a.kind in ("RA", "SG"))
        if a.kind in ("SA", "SG"):
            return (rank, t.peer, a.kind[1], a.mb, b, t.start)
        return (t.peer, rank, a.kind[1], a.mb, b, t.start)

    def duration(self, rank: int, a: Action) -> float:
        if a.kind in ("L", "OPT"):  # the loader is not modelled; the optimizer steps all of the rank's chunks
            st, rep = self.where[rank]
            return 0.0 if a.kind == "L" else sum(
                self.cm.optimizer_s(st.type_of(rep), c0, c1, st.width, st.degree_of(rep),
                                    self.plan.shards_optimizer(st), whole_state(self.cm, st, c0, c1))
                for c0, c1 in st.chunk_ranges)
        k = (rank, a.chunk)
        if k not in self.durations:
            st, rep = self.where[rank]
            first, last = st.layers if a.chunk is None else self.plan.pipeline[a.chunk][3:]
            t = st.type_of(rep)
            tp = st.degree_of(rep)
            tp_f, tp_b = self.cm.stage_tp_allreduce_s(t, first, last, rep.samples, st.recompute, tp)
            # a chunk whose list has W actions runs each backward in two: input gradients (B), weights' (W)
            split = any(b.kind == "W" and b.chunk == a.chunk for b in self.sched[rank])
            fwd, bwd, wgt = pass_times_s(self.cm, t, first, last, rep.samples, st.recompute, tp, split)
            self.durations[k] = {"F": fwd, "B": bwd, "W": wgt, "TPF": tp_f, "TPB": tp_b}
        return self.durations[k][a.kind]

    def transfer_s(self, src: int, dst: int, boundary: int, rows: int) -> tuple[float, bool]:
        """(seconds, same host) of moving ``rows`` rows of the tensor crossing ``boundary`` from src to dst (a
        rank handing a chunk's output to its own next chunk moves nothing)."""
        k = (src, dst, boundary, rows)
        if k not in self.transfer_cache:
            (sst, srep), (dst_st, drep) = self.where[src], self.where[dst]
            bd = self.plan.boundary(boundary)
            layer = self.plan.pipeline[boundary].last - 1
            nbytes = rows * float(self.cm.layers.out_bytes[layer]) * self.cm.wire_factor(bd.dtype if bd else None)
            same = srep.host == drep.host
            t = 0.0 if src == dst else self.cm.p2p_s(nbytes, sst.type_of(srep), dst_st.type_of(drep), same)
            self.transfer_cache[k] = (t, same)
        return self.transfer_cache[k]

    def start_transfer(self, key: tuple, stop: int) -> None:
        """Both halves are posted and head their groups' queues: the data moves once the links are free."""
        src, dst, kind, mb, boundary, start_row = key
        dur, same = self.transfer_s(src, dst, boundary, stop - start_row)
        lanes = self.key_lanes.get(key, ())
        begin = max([self.send_post[key], self.recv_post[key]] + [self.lane_free.get(q, 0.0) for q in lanes])
        if not same:
            srep, drep = self.where[src][1], self.where[dst][1]
            out, inn = self.nic_out.setdefault(srep.host, []), self.nic_in.setdefault(drep.host, [])
            begin = _first_gap(inn, _first_gap(out, begin, dur), dur)
            while _first_gap(out, begin, dur) != begin:  # free on both NICs at once
                begin = _first_gap(inn, _first_gap(out, begin, dur), dur)
            bisect.insort(out, (begin, begin + dur))
            bisect.insort(inn, (begin, begin + dur))
        self.done[key] = begin + dur
        self.woken += (src, dst)
        self.events.append(Event(src, f"{kind}{mb}>r{dst}", "transfer", mb, begin, begin + dur))
        for q in lanes:
            self.lanes[q].popleft()
            self.lane_free[q] = begin + dur

    def _run_heads(self, lanes: list[tuple]) -> None:
        """Start every transfer that heads both of its queues and is posted on both sides, following the chain
        each start opens (a loop, not recursion: one post can release a whole pipeline's queued transfers)."""
        while lanes:
            queue = self.lanes.get(lanes.pop())
            if not queue:
                continue
            key = queue[0]
            mine = self.key_lanes[key]
            if key in self.send_post and key in self.recv_post and all(self.lanes[q][0] == key for q in mine):
                self.start_transfer(key, self.key_stop[key])
                lanes.extend(mine)

    def post(self, r: int, a: Action) -> None:
        sending = a.kind in ("SA", "SG")
        group = transfer_group(a.kind, vstage(self.plan, r, a))
        keys = []
        for t in a.transfers:
            k = self.key(r, a, t)
            (self.send_post if sending else self.recv_post)[k] = self.clock[r]
            keys.append(k)
            if t.peer != r:  # a rank handing rows to itself runs no operation
                lane = (r, group)
                self.lanes.setdefault(lane, deque()).append(k)
                self.key_lanes[k] = self.key_lanes.get(k, ()) + (lane,)
                self.key_stop[k] = t.stop
                self._run_heads([lane])
            elif k in self.send_post and k in self.recv_post:
                self.start_transfer(k, t.stop)
        if not sending:
            self.recv_keys[(r, a.kind[1], a.mb, a.chunk)] = keys

    def data_ready(self, r: int, a: Action) -> Optional[float]:
        """When the rows a forward/backward needs have arrived (0 if it needs none); None: not yet known."""
        need = ("A" if a.kind == "F" else "G", a.mb, a.chunk)
        if need not in self.receives[r]:
            return 0.0
        keys = self.recv_keys.get((r, *need))
        if keys is None or any(k not in self.done for k in keys):
            return None
        return max(self.done[k] for k in keys)

    def in_allreduce(self, r: int) -> bool:
        """Whether rank r waits in its stage's all-reduce for the other replicas."""
        return r in self.ar_waiting.get(self.where[r][0].index, ())

    def try_allreduce(self, r: int) -> bool:
        st = self.where[r][0]
        waiting = self.ar_waiting.setdefault(st.index, {})  # counted per stage: a stage may be 65,536 wide
        waiting.setdefault(r, self.clock[r])
        if len(waiting) < st.width:
            return False
        group = [rep.rank for rep in st.replicas]
        arrived = [waiting[q] for q in group]
        del self.ar_waiting[st.index]
        # the buckets' all-reduce runs during each replica's last gradient pass (``CostModel.allreduce_end_s``)
        ar, buckets, rest = self.cm.stage_sync_parts(self.plan, st.index)
        passes = [self.last_grad.get(q, (self.clock[q], 0.0)) for q in group]
        start = max(arrived)
        end = max(start, float(allreduce_end_s(ar, buckets, [e for e, _ in passes], [h for _, h in passes]))
                  ) + rest
        for q in group:
            self.events.append(Event(q, "AR", "allreduce", None, start, end))
            self.clock[q] = end
            self.pc[q] += 1
        self.woken += group
        return True

    def window_free(self, r: int, a: Action) -> Optional[float]:
        """When send ``a`` may post: once each peer has fewer than ``SEND_WINDOW`` unfinished sends from rank r
        (the runtime waits for the oldest); None: one of those has not started yet."""
        t = self.clock[r]
        for tr in a.transfers:
            held = self.held.get((r, a.kind, tr.peer), [])
            while len(held) >= SEND_WINDOW:
                if held[0] not in self.done:
                    return None
                t = max(t, self.done[held.pop(0)])
            held[:] = [k for k in held if k not in self.done or self.done[k] > t]
        return t

    def step(self, r: int) -> bool:
        """Advance rank r by one action if it can; False when it must wait."""
        a = self.sched[r][self.pc[r]]
        if a.kind in ("SA", "SG"):
            t = self.window_free(r, a)
            if t is None:
                return False
            self.clock[r] = t
            self.post(r, a)
            for tr in a.transfers:
                if tr.peer != r:
                    self.held.setdefault((r, a.kind, tr.peer), []).append(self.key(r, a, tr))
        elif a.kind in ("RA", "RG"):
            self.post(r, a)
        elif a.kind == "AR":
            return self.try_allreduce(r)
        else:
            begin = self.clock[r]
            if a.kind in ("F", "B"):
                ready = self.data_ready(r, a)
                if ready is None:
                    return False
                begin = max(begin, ready)
            d = self.duration(r, a)
            self.events.append(Event(r, str(a), a.kind, a.mb, begin, begin + d))
            if a.kind == "W":
                self.compute[r] += d
            if a.kind == "W" or (a.kind == "B" and (a.mb, a.chunk) not in self.split_mbs[r]):
                self.last_grad[r] = (begin + d, d)
            if a.kind in ("F", "B"):
                self.compute[r] += d
                comm = self.durations[(r, a.chunk)]["TP" + a.kind]
                if comm > 0:  # the tensor-parallel all-reduces inside it, shown as their own track slice
                    self.events.append(Event(r, f"TP all-reduce {a}", "tp", a.mb, begin + d - comm, begin + d))
            self.clock[r] = begin + d
        self.pc[r] += 1
        return True

    def run(self, deadline: Optional[float] = None) -> SimResult:
        """Steps the rank whose clock is earliest, one action at a time, so that transfers book their NICs in the
        order they are posted. (Stepping each rank as far as it could, rank by rank, let a rank's later transfers
        book a NIC ahead of other ranks' earlier ones: on busy NICs the replay then moved by up to 10% with the
        ranks' numbering.) A rank that must wait leaves the queue until a transfer it is a party to is booked or
        its stage's all-reduce ends."""
        ranks = sorted(self.sched)  # replicas (tensor-parallel groups replay as their lead)
        heap = [(0.0, r) for r in ranks]
        queued = set(ranks)
        steps = 0
        while heap:
            steps += 1
            if deadline is not None and steps % 256 == 1 and time.perf_counter() > deadline:
                raise OutOfTime(f"the replay of {self.plan.num_stages} stages on {len(ranks)} replicas ran past "
                                f"its deadline")
            _, r = heapq.heappop(heap)
            queued.discard(r)
            moved = self.pc[r] < len(self.sched[r]) and not self.in_allreduce(r) and self.step(r)
            for q in ([r] if moved else []) + self.woken:
                if q not in queued and self.pc[q] < len(self.sched[q]):
                    heapq.heappush(heap, (self.clock[q], q))
                    queued.add(q)
            self.woken.clear()
        stuck = [r for r in ranks if self.pc[r] < len(self.sched[r])]
        if stuck:
            raise self.deadlock(stuck)
        # and every rank's control all-reduces (the loss, the clipped norm, fp16's vote): a latency-bound ring each
        it = max(self.clock + list(self.done.values())) + self.cm.control_syncs_s(self.plan, self.train)
        busy = {r: self.compute[r] / it for r in ranks}
        return SimResult(iteration_s=it, samples_per_s=self.plan.global_batch_size / it,
                         bubble_fraction=1.0 - sum(busy.values()) / len(ranks), busy=busy, events=self.events)

    def deadlock(self, stuck: list[int]) -> ScheduleError:
        def what(r: int) -> str:
            a = self.sched[r][self.pc[r]]
            if a.kind == "AR":
                return f"{a} waits for stage {self.where[r][0].index}'s replicas"
            need = ("A" if a.kind == "F" else "G", a.mb, a.chunk)
            keys = self.recv_keys.get((r, *need))
            if keys is None:
                return f"{a} waits for its receive R{need[0]}{a.mb}, which is not posted before it"
            peers = sorted({k[0] for k in keys if k not in self.done})
            return f"{a} waits for data from rank(s) {', '.join(map(str, peers))}"
        r = stuck[0]
        others = "; ".join(f"rank {q} at step {self.pc[q]} ({what(q)})" for q in stuck[1:4])
        return ScheduleError(f"rank {r} step {self.pc[r]}", f"deadlock: {what(r)}"
                                                             + (f"; also blocked: {others}" if others else ""))


def write_trace(result: SimResult, plan: Plan, path: str, inputs: tuple = ()) -> None:
    write_atomic(path, json.dumps(result.chrome_trace(plan)), "--trace", inputs)


def require_matplotlib():
    """matplotlib, or one line saying how to get it (asked before any replay: a missing package is said first)."""
    try:
        import matplotlib
    except ImportError:
        raise missing_package("--png", "matplotlib") from None
    return matplotlib


def write_png(result: SimResult, plan: Plan, path: str, title: str = "", inputs: tuple = ()) -> None:
    """Timeline: one row per rank, colour per micro-batch; forward solid, backward hatched, transfers thin."""
    matplotlib = require_matplotlib()
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    leads = lead_ranks(plan)  # one row per replica (a tensor-parallel group as its lead)
    row = {r: k for k, r in enumerate(leads)}
    n = len(leads)
    fig, ax = plt.subplots(figsize=(12, 0.45 * n + 2.0))
    # tab20 without its two greys (transfers, all-reduce) and its two oranges (tensor-parallel all-reduce)
    palette = [c for k, c in enumerate(plt.get_cmap("tab20").colors) if k not in (2, 3, 14, 15)]
    cmap = lambda mb: palette[mb % len(palette)]  # noqa: E731
    scale = 1e3  # ms
    span = result.iteration_s * scale
    for e in result.events:
        y = n - 1 - row[e.rank]
        x, w = e.start_s * scale, max((e.end_s - e.start_s) * scale, 0.0)
        if e.kind in ("F", "B", "W"):
            ax.broken_barh([(x, w)], (y - 0.4, 0.8), facecolors=cmap(e.mb), edgecolor="black", linewidth=0.3,
                           hatch="///" if e.kind == "B" else None, alpha=1.0 if e.kind == "F" else 0.75)
            if "@" in e.name and w >= 0.012 * span:  # a chunked plan: which chunk the pass ran
                ax.text(x + w / 2, y, e.name.split("@")[1], ha="center", va="center", fontsize=5)
        elif e.kind == "transfer":
            ax.broken_barh([(x, w)], (y - 0.45, 0.12), facecolors="dimgray")
        elif e.kind == "tp":  # tensor-parallel all-reduces inside a forward/backward
            ax.broken_barh([(x, w)], (y + 0.25, 0.15), facecolors="darkorange")
        elif e.kind in ("allreduce", "OPT"):
            ax.broken_barh([(x, w)], (y - 0.4, 0.8), facecolors="lightgray" if e.kind == "allreduce" else "black")
    labels = []
    for r in reversed(leads):
        s, j = plan.locate(r)
        st = plan.stages[s]
        tp = f" tp{st.degree_of(st.replicas[j])}" if st.degree_of(st.replicas[j]) > 1 else ""
        labels.append(f"r{r} s{s} {st.type_of(st.replicas[j])}{tp}")
    ax.set_yticks(range(n))
    ax.set_yticklabels(labels, fontsize=8)
    ax.set_xlabel("ms")
    ax.set_title(title or f"{plan.model.name}: {count(plan.num_stages, 'stage')}, {count(plan.world_size, 'rank')}, "
                          f"predicted {result.iteration_s * 1e3:.1f} ms/iteration (simulated), bubble "
                          f"{result.bubble_fraction:.1%}", fontsize=10)
    fig.legend(handles=[Patch(facecolor="white", edgecolor="black", label="forward"),
                       Patch(facecolor="white", edgecolor="black", hatch="///", label="backward"),
                       Patch(facecolor="dimgray", label="transfer"), Patch(facecolor="lightgray", label="all-reduce"),
                       Patch(facecolor="darkorange", label="tensor-parallel all-reduce"),
                       Patch(facecolor="black", label="optimizer")], loc="lower center", fontsize=7, ncol=6,
               frameon=False)
    # the legend below the axes, never over the top rank's row
    fig.tight_layout(rect=(0, 0.4 / fig.get_figheight(), 1, 1))
    try:
        write_atomic(path, lambda tmp: fig.savefig(tmp, dpi=110), "--png", inputs)
    finally:
        plt.close(fig)
