"""A pipeline schedule as data: per rank, the ordered actions of one iteration.

Each action prints as short text and parses back (``Action.parse(str(a)) == a``):

    L3                  load micro-batch 3 (first stage: inputs; last stage: labels)
    F3  / B3            forward / backward of micro-batch 3 on this rank's rows
    SA3>r5[0:2]>r6[2:4] send micro-batch 3's activations: rows 0..2 to rank 5, rows 2..4 to rank 6
    RA3<r1[0:4]         receive micro-batch 3's activations (rows in micro-batch coordinates)
    SG3>r1[0:4]         send micro-batch 3's input gradients upstream
    RG3<r5[0:2]<r6[2:4] receive micro-batch 3's output gradients from downstream
    AR                  all-reduce gradients within the stage's replicas
    OPT                 optimizer step

The transfers of one action are issued together and waited together (the runtime's batched
isend/irecv). The order of a stage's actions is DeepSpeed's 1F1B ``TrainSchedule`` (the runtime runs
that schedule; a test checks the two agree), so the simulator replays what the runtime executes.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from .records import Plan

KINDS = ("L", "F", "B", "SA", "RA", "SG", "RG", "AR", "OPT")


@dataclass(frozen=True)
class Transfer:
    peer: int
    start: int  # first row, micro-batch coordinates
    stop: int


@dataclass(frozen=True)
class Action:
    kind: str
    mb: Optional[int] = None
    transfers: tuple[Transfer, ...] = ()

    def __str__(self) -> str:
        if self.kind in ("AR", "OPT"):
            return self.kind
        arrow = ">" if self.kind in ("SA", "SG") else "<"
        return f"{self.kind}{self.mb}" + "".join(f"{arrow}r{t.peer}[{t.start}:{t.stop}]" for t in self.transfers)

    _RE = re.compile(r"^(OPT|AR|SA|RA|SG|RG|L|F|B)(\d*)((?:[<>]r\d+\[\d+:\d+\])*)$")
    _T = re.compile(r"([<>])r(\d+)\[(\d+):(\d+)\]")

    @classmethod
    def parse(cls, text: str) -> "Action":
        m = cls._RE.match(text.strip())
        if not m:
            raise ValueError(f"not a schedule action: {text!r}")
        kind, mb, rest = m.groups()
        if kind in ("AR", "OPT"):
            if mb or rest:
                raise ValueError(f"{kind} takes no micro-batch or peers: {text!r}")
            return cls(kind)
        if not mb:
            raise ValueError(f"{kind} needs a micro-batch number: {text!r}")
        want = ">" if kind in ("SA", "SG") else "<"
        transfers = []
        for arrow, peer, a, b in cls._T.findall(rest):
            if arrow != want:
                raise ValueError(f"{kind} transfers use {want!r}: {text!r}")
            transfers.append(Transfer(int(peer), int(a), int(b)))
        if kind in ("SA", "RA", "SG", "RG") and not transfers:
            raise ValueError(f"{kind} needs at least one peer: {text!r}")
        if kind in ("L", "F", "B") and transfers:
            raise ValueError(f"{kind} takes no peers: {text!r}")
        return cls(kind, int(mb), tuple(transfers))


def format_schedule(actions: list[Action]) -> str:
    return " ".join(str(a) for a in actions)


def parse_schedule(text: str) -> list[Action]:
    return [Action.parse(tok) for tok in text.split()]


def stage_order(num_micro_batches: int, num_stages: int, stage: int) -> list[tuple[str, Optional[int]]]:
    """DeepSpeed's TrainSchedule for one stage as (instruction, micro-batch) pairs, in execution order.

    Re-derived here in pure Python (the planner must not import deepspeed): steps alternate forward and
    backward by the parity of step and stage; a forward step receives activations (and first sends the
    previous step's input gradients), a backward step receives output gradients (and first sends the
    previous step's activations).
    """
    M, S, s = num_micro_batches, num_stages, stage
    valid = lambda mb: 0 <= mb < M  # noqa: E731
    out: list[tuple[str, Optional[int]]] = []
    prev = -1
    total = 2 * (M + S - 1)
    for step in range(total):
        even_step, even_stage = step % 2 == 0, s % 2 == 0
        if even_step and even_stage:
            mb, fwd = step // 2 - s // 2, True
        elif not even_step and not even_stage:
            mb, fwd = (step - 1) // 2 - s // 2, True
        elif even_step and not even_stage:
            mb, fwd = step // 2 - S + (s + 1) // 2, False
        else:
            mb, fwd = ((step - 1) // 2) - S + 1 + s // 2, False
        if fwd:
            if valid(prev) and s > 0:
                out.append(("SG", prev))
            if valid(mb) and s > 0:
                out.append(("RA", mb))
        else:
            if valid(mb) and s < S - 1:
                out.append(("RG", mb))
            if valid(prev) and s < S - 1:
                out.append(("SA", prev))
        if (s == 0 or s == S - 1) and fwd and valid(mb):
            out.append(("L", mb))
        if valid(mb):
            out.append(("F" if fwd else "B", mb))
        if step == total - 1:
            out.append(("AR", None))
            out.append(("OPT", None))
        prev = mb
    return out


def overlaps(plan: Plan, s: int, replica: int, direction: str) -> tuple[Transfer, ...]:
    """Transfers between replica ``replica`` of stage s and the overlapping replicas of the neighbour stage."""
    other = s + 1 if direction == "next" else s - 1
    if not 0 <= other < plan.num_stages:
        return ()
    a, b = plan.stages[s].sample_ranges()[replica]
    out = []
    for rep, (c, d) in zip(plan.stages[other].replicas, plan.stages[other].sample_ranges()):
        lo, hi = max(a, c), min(b, d)
        if lo < hi:
            out.append(Transfer(rep.rank, lo, hi))
    return tuple(out)


def build_schedule(plan: Plan) -> dict[int, list[Action]]:
    """Per global rank, the actions of one training iteration under the plan."""
    out: dict[int, list[Action]] = {}
    for s, st in enumerate(plan.stages):
        order = stage_order(plan.num_micro_batches, plan.num_stages, s)
        for j, rep in enumerate(st.replicas):
            nxt, prv = overlaps(plan, s, j, "next"), overlaps(plan, s, j, "prev")
            acts = []
            for kind, mb in order:
                if kind in ("SA", "RG"):
                    acts.append(Action(kind, mb, nxt))
                elif kind in ("RA", "SG"):
                    acts.append(Action(kind, mb, prv))
                else:
                    acts.append(Action(kind, mb))
            out[rep.rank] = acts
    return out
