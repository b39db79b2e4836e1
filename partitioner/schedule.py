"""A pipeline schedule as data: per rank, the ordered actions of one iteration.

Each action prints as short text and parses back (``Action.parse(str(a)) == a``):

    L3                  load micro-batch 3 (first stage: inputs; last stage: labels)
    RA3<r1[0:4]         post the receive of micro-batch 3's activations (rows in micro-batch coordinates)
    F3                  forward of micro-batch 3 on this rank's rows; first waits for RA3's data
    SA3>r5[0:2]>r6[2:4] post the send of micro-batch 3's activations: rows 0..2 to rank 5, 2..4 to rank 6
    RG3<r5[0:2]<r6[2:4] post the receive of micro-batch 3's output gradients from downstream
    B3                  backward of micro-batch 3; first waits for RG3's data (with a W3 later on the
                        rank: the input gradients only, so that SG3 leaves before the weights' share)
    W3                  the weight gradients of micro-batch 3 (schedule ``zb-h1``)
    SG3>r1[0:4]         post the send of micro-batch 3's input gradients upstream
    AR                  all-reduce gradients within the stage's replicas
    OPT                 optimizer step

Transfers never block the rank that posts them: a send is an ``isend`` that completes in the
background once the receiver has posted its ``irecv``; a receive is posted ahead and only the
forward/backward that needs its rows waits for it. So a stage waits on a neighbour exactly as long
as the data dependency requires, never on the neighbour's progress through its own schedule
(DeepSpeed's TrainSchedule pairs blocking send/recv steps, which couples neighbours). At the end of
the iteration every send still in flight is waited for.

``build_schedule`` writes 1F1B (PipeDream-flush): stage s runs min(S-s-1, M) warm-up forwards, then
alternates one forward and one backward, then drains; receives of activations are posted one
micro-batch ahead (at most two in flight), receives of gradients right after the forward that makes
them. Sends in flight per rank are bounded by 1F1B itself: a stage is at most S-s micro-batches ahead
of its last backward. The runtime (``hethub.runtime.executor``) executes exactly these lists and the simulator
(``simulator.simulate``) replays them, so what is predicted is what runs.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from .chunked import chunk_orders, one_chunk_order
from .errors import InputError
from .records import SCHEDULES, Plan
from .schedule_kinds import kind as schedule_kind

__all__ = ["SCHEDULES", "Action", "Transfer", "build_schedule", "parse_schedule", "format_schedule"]


def peak_in_flight(schedule: str, num_stages: int, stage: int, num_micro_batches: int) -> int:
    """``ScheduleKind.peak_in_flight`` of ``schedule``."""
    return schedule_kind(schedule).peak_in_flight(num_stages, stage, num_micro_batches)


def trailing_weight_passes(schedule: str, num_stages: int, stage: int, num_micro_batches: int) -> int:
    """``ScheduleKind.trailing_weight_passes`` of ``schedule``."""
    return schedule_kind(schedule).trailing_weight_passes(num_stages, stage, num_micro_batches)


@dataclass(frozen=True)
class Transfer:
    peer: int
    start: int  # first row, micro-batch coordinates
    stop: int


@dataclass(frozen=True)
class Action:
    """``chunk``: the pipeline position of the chunk the action runs or moves data of (``Plan.pipeline``), in a
    plan whose groups hold several chunks, written ``F3@5``; None (and not written) with one chunk per group."""
    kind: str
    mb: Optional[int] = None
    transfers: tuple[Transfer, ...] = ()
    chunk: Optional[int] = None

    def __str__(self) -> str:
        if self.kind in ("AR", "OPT"):
            return self.kind
        arrow = ">" if self.kind in ("SA", "SG") else "<"
        at = f"@{self.chunk}" if self.chunk is not None else ""
        return f"{self.kind}{self.mb}{at}" + "".join(f"{arrow}r{t.peer}[{t.start}:{t.stop}]" for t in self.transfers)

    _RE = re.compile(r"^(OPT|AR|SA|RA|SG|RG|L|F|B|W)(\d*)(?:@(\d+))?((?:[<>]r\d+\[\d+:\d+\])*)$")
    _T = re.compile(r"([<>])r(\d+)\[(\d+):(\d+)\]")

    @classmethod
    def parse(cls, text: str) -> "Action":
        m = cls._RE.match(text.strip())
        if not m:
            raise ValueError(f"not a schedule action: {text!r}")
        kind, mb, chunk, rest = m.groups()
        if kind in ("AR", "OPT"):
            if mb or rest or chunk:
                raise ValueError(f"{kind} takes no micro-batch, chunk or peers: {text!r}")
            return cls(kind)
        if not mb:
            raise ValueError(f"{kind} needs a micro-batch number: {text!r}")
        if kind == "L" and chunk:
            raise ValueError(f"L loads a micro-batch for the whole rank, it takes no chunk: {text!r}")
        want = ">" if kind in ("SA", "SG") else "<"
        transfers = []
        for arrow, peer, a, b in cls._T.findall(rest):
            if arrow != want:
                raise ValueError(f"{kind} transfers use {want!r}: {text!r}")
            transfers.append(Transfer(int(peer), int(a), int(b)))
        if kind in ("SA", "RA", "SG", "RG") and not transfers:
            raise ValueError(f"{kind} needs at least one peer: {text!r}")
        if kind in ("L", "F", "B", "W") and transfers:
            raise ValueError(f"{kind} takes no peers: {text!r}")
        return cls(kind, int(mb), tuple(transfers), int(chunk) if chunk else None)


def format_schedule(actions: list[Action]) -> str:
    return " ".join(str(a) for a in actions)


def parse_schedule(text: str) -> list[Action]:
    return [Action.parse(tok) for tok in text.split()]


def stage_order(num_micro_batches: int, num_stages: int, stage: int, train: bool = True, split: bool = False
                ) -> list[tuple[str, Optional[int]]]:
    """1F1B for one stage as (action kind, micro-batch) pairs, in execution order (``train=False``:
    forwards only, for evaluation): the compute order (``chunked.one_chunk_order``; ``split``: schedule
    ``zb-h1``'s) with the transfers and loads placed around it."""
    M, S, s = num_micro_batches, num_stages, stage
    first, last = s == 0, s == S - 1
    compute = one_chunk_order(M, S, s, train, split)
    out: list[tuple[str, Optional[int]]] = []
    next_ra = 0  # the next micro-batch whose activations' receive is not posted yet
    for kind, mb in compute:
        if kind == "F":
            while not first and next_ra <= min(mb + 1, M - 1):  # this one and one ahead
                out.append(("RA", next_ra))
                next_ra += 1
            if first or last:
                out.append(("L", mb))
            out.append(("F", mb))
            if not last:
                out.append(("SA", mb))
                if train:
                    out.append(("RG", mb))
        elif kind == "B":
            out.append(("B", mb))
            if not first:
                out.append(("SG", mb))
        else:
            out.append((kind, mb))
    if train:
        out += [("AR", None), ("OPT", None)]
    return out


def overlaps(plan: Plan, s: int, replica: int, direction: str) -> tuple[Transfer, ...]:
    """Transfers between replica ``replica`` of stage s and the overlapping replicas of the neighbour stage (in a
    chunked plan: of chunk s's group and the group of the chunk before or after it, ``Plan.pipeline``)."""
    other = s + 1 if direction == "next" else s - 1
    if not 0 <= other < len(plan.pipeline):
        return ()
    here, there = plan.stages[plan.pipeline[s].group], plan.stages[plan.pipeline[other].group]
    a, b = here.sample_ranges()[replica]
    out = []
    for rep, (c, d) in zip(there.replicas, there.sample_ranges()):
        lo, hi = max(a, c), min(b, d)
        if lo < hi:
            out.append(Transfer(rep.rank, lo, hi))
    return tuple(out)


def build_schedule(plan: Plan, train: bool = True, num_micro_batches: Optional[int] = None
                   ) -> dict[int, list[Action]]:
    """Per replica (keyed by its lead rank), the actions of one training (or, ``train=False``, evaluation)
    iteration. A tensor-parallel group's other ranks run their lead's list: the lead alone talks to the
    neighbouring stages and shares what it receives within the group (hethub's engine)."""
    M = num_micro_batches or plan.num_micro_batches
    if schedule_kind(plan.schedule).chunked:
        return _build_chunked(plan, M, train)
    out: dict[int, list[Action]] = {}
    for s, st in enumerate(plan.stages):
        order = stage_order(M, plan.num_stages, s, train, split=schedule_kind(plan.schedule).splits(s))
        for j, rep in enumerate(st.replicas):
            nxt, prv = overlaps(plan, s, j, "next"), overlaps(plan, s, j, "prev")
            peers = {"SA": nxt, "RG": nxt, "RA": prv, "SG": prv}
            out[rep.rank] = [Action(kind, mb, peers.get(kind, ())) for kind, mb in order]
    return out


def lower_chunked(order, V: int, train: bool) -> list[tuple[str, Optional[int], Optional[int]]]:
    """A chunked compute order (``chunked``) as (kind, micro-batch, chunk) actions, placed as 1F1B's are: the
    receive of a forward's activations posted at the forward before it when that one is of the same chunk (the
    first receive on a boundary waits for its metadata, which a chunk further on would only send after this
    forward: posting it sooner deadlocks), else at its own forward; the micro-batch
    loaded once per rank before the first forward of the first or last chunk that needs it, the activations sent
    and their gradients' receive posted right after the forward, input gradients sent right after the backward."""
    forwards = [(mb, k) for kind, mb, k in order if kind == "F"]
    at = {fk: i for i, fk in enumerate(forwards)}
    out: list[tuple[str, Optional[int], Optional[int]]] = []
    posted, loaded = set(), set()
    for kind, mb, k in order:
        if kind == "F":
            for mm, kk in forwards[at[(mb, k)]:at[(mb, k)] + 2]:  # this one and one ahead of the same chunk
                if kk > 0 and kk == k and (mm, kk) not in posted:
                    out.append(("RA", mm, kk))
                    posted.add((mm, kk))
            if k in (0, V - 1) and mb not in loaded:
                out.append(("L", mb, None))
                loaded.add(mb)
            out.append(("F", mb, k))
            if k < V - 1:
                out.append(("SA", mb, k))
                if train:
                    out.append(("RG", mb, k))
        elif kind == "B":
            out.append(("B", mb, k))
            if k > 0:
                out.append(("SG", mb, k))
        else:
            out.append((kind, mb, k))
    if train:
        out += [("AR", None, None), ("OPT", None, None)]
    return out


def _build_chunked(plan: Plan, M: int, train: bool) -> dict[int, list[Action]]:
    V = len(plan.pipeline)
    out: dict[int, list[Action]] = {}
    for g, order in enumerate(chunk_orders(plan, M, train)):
        lowered = lower_chunked(order, V, train)
        for j, rep in enumerate(plan.stages[g].replicas):
            peers = {}
            for k in plan.chunks_of_group[g]:
                nxt, prv = overlaps(plan, k, j, "next"), overlaps(plan, k, j, "prev")
                peers.update({("SA", k): nxt, ("RG", k): nxt, ("RA", k): prv, ("SG", k): prv})
            out[rep.rank] = [Action(kind, mb, peers.get((kind, k), ()), k) for kind, mb, k in lowered]
    return out


def lead_ranks(plan: Plan) -> list[int]:
    """The rank of every replica (the lead of a tensor-parallel group): the keys of a schedule."""
    return sorted(rep.rank for st in plan.stages for rep in st.replicas)


def read_schedule_file(path: str) -> dict[int, list[Action]]:
    """A schedule file: one line per rank, ``RANK: ACTION ACTION ...`` (``#`` starts a comment line)."""
    sched: dict[int, list[Action]] = {}
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError("--schedule", f"cannot read {path!r}: {type(exc).__name__}: {exc}"[:200]) from None
    for lineno, line in enumerate(lines, 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        rank, sep, text = line.partition(":")
        try:
            if not sep:
                raise ValueError("expected 'RANK: ACTION ACTION ...'")
            r = int(rank)
            if r in sched:
                raise ValueError(f"rank {r} listed twice")
            sched[r] = parse_schedule(text)
        except ValueError as exc:
            raise InputError(f"{path}:{lineno}", str(exc)[:200]) from None
    return sched
