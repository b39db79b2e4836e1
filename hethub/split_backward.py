"""A stage's backward in two passes, for the ``zb-h1`` schedule: input gradients first, weights' later.

A stage's backward computes two things: the gradient of its input, which the previous stage is
waiting for, and the gradients of its own weights, which nobody needs before the all-reduce. Running
the first alone (``B``), sending it, and computing the second afterwards (``W``) takes the weight
gradients off the critical path through the pipeline (Qi et al. 2023, "Zero Bubble Pipeline
Parallelism"; ``partitioner.schedule.SCHEDULES``).

How, with public autograd API only: the autograd graph from the stage's outputs is walked once. Its
*frontier* nodes are where a weight's path joins the path from the input (a Linear's ``AddmmBackward``,
which receives dY and produces both dX and dW). The input pass is ``torch.autograd.grad`` to the
inputs alone (autograd then skips every weight branch) with the graph kept, and a pre-hook on each
frontier node records the gradient arriving there. The weight pass resumes from exactly those nodes
(``GradientEdge`` outputs with the recorded gradients) down to the weights, one call per group of
weights that share frontier nodes, so no part of the backward runs twice. Each weight gradient is the
same product one backward computes, accumulated into ``.grad`` in micro-batch order, so a split run
trains like an unsplit one (the tests compare in float64).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
from torch.autograd.graph import GradientEdge


class SplitBackwardError(RuntimeError):
    """A stage whose weights do not depend on its input: their gradients cannot wait for a weight pass."""


def _accumulator(p: torch.Tensor):
    """The node that accumulates a leaf's gradient (created on demand, as autograd itself does)."""
    return p.view_as(p).grad_fn.next_functions[0][0]


def _node(t: torch.Tensor):
    return t.grad_fn if t.grad_fn is not None else _accumulator(t)


@dataclass
class _Group:
    """Weights that share frontier nodes, and the gradients recorded at those nodes."""
    weights: list[int] = field(default_factory=list)  # indices into the stage's weights
    frontier: list = field(default_factory=list)  # autograd nodes
    grads: dict = field(default_factory=dict)  # node -> the grad_outputs tuple it received in the input pass


def _consumers(roots: Sequence) -> dict:
    """node -> the nodes that pass gradients into it, over the graph reachable from ``roots``."""
    out: dict = {}
    stack = list(roots)
    seen = set(roots)
    while stack:
        node = stack.pop()
        for child, _ in node.next_functions:
            if child is None:
                continue
            out.setdefault(child, []).append(node)
            if child not in seen:
                seen.add(child)
                stack.append(child)
    return out


def _upward(start: Sequence, consumers: dict, stop=lambda n: False) -> tuple[set, set]:
    """(visited, stopped-at) nodes walking from ``start`` towards the roots, not past nodes where ``stop``."""
    seen, hit, stack = set(start), set(), list(start)
    while stack:
        node = stack.pop()
        for up in consumers.get(node, ()):
            if up in seen:
                continue
            seen.add(up)
            if stop(up):
                hit.add(up)
            else:
                stack.append(up)
    return seen, hit


def _groups(roots: Sequence, inputs: Sequence[torch.Tensor], weights: Sequence[torch.Tensor], stage: int
            ) -> list[_Group]:
    consumers = _consumers(roots)
    on_input_path, _ = _upward([_node(x) for x in inputs], consumers)  # nodes whose backward reaches an input
    groups: list[_Group] = []
    owner: dict = {}  # frontier node -> its group
    lost = 0
    for i, w in enumerate(weights):
        acc = _accumulator(w)
        if acc not in consumers:
            continue  # the roots do not depend on this weight: it gets no gradient, as in one backward
        _, frontier = _upward([acc], consumers, stop=lambda n: n in on_input_path)
        if not frontier:
            lost += 1
            continue
        joined = {id(owner[n]): owner[n] for n in frontier if n in owner}
        g = _Group()
        for other in joined.values():  # merge every group sharing a frontier node with this weight
            g.weights += other.weights
            g.frontier += other.frontier
            groups.remove(other)
        g.weights.append(i)
        g.frontier += [n for n in frontier if n not in owner]
        for n in g.frontier:
            owner[n] = g
        groups.append(g)
    if lost:
        raise SplitBackwardError(f"schedule zb-h1: {lost} weight(s) of stage {stage} do not depend on the stage's "
                                 f"input, so their gradients cannot be split from it; plan with --schedule 1f1b")
    return groups


def backward_input(roots: Sequence[torch.Tensor], root_grads: Optional[Sequence[torch.Tensor]],
                   inputs: Sequence[torch.Tensor], weights: Sequence[torch.Tensor], stage: int) -> list[_Group]:
    """Input gradients of ``roots`` (the stage's outputs with their received gradients, or the loss with
    ``root_grads=None``), added to each input's ``.grad``; returns what ``backward_weight`` resumes from."""
    groups = _groups([r.grad_fn for r in roots], inputs, weights, stage)
    records = [n.register_prehook(lambda grads, g=g, n=n: g.grads.__setitem__(n, grads))
               for g in groups for n in g.frontier]
    _accumulate(inputs, _grad(records, list(roots), list(inputs), root_grads, retain_graph=True))
    return groups


def _grad(hooks: list, outputs, inputs, grads, **kw):
    """``torch.autograd.grad`` with ``hooks`` (pre-hook handles) in place for it, removed after it."""
    try:
        return torch.autograd.grad(outputs, inputs, grads, allow_unused=True, **kw)
    finally:
        for h in hooks:
            h.remove()


def _accumulate(tensors: Sequence[torch.Tensor], grads) -> None:
    """Add each gradient to its tensor's ``.grad``, as autograd's accumulation would."""
    for t, g in zip(tensors, grads):
        if g is not None:
            if t.grad is None:
                t.grad = g
            else:
                t.grad.add_(g)


def backward_weight(weights: Sequence[torch.Tensor], groups: list[_Group]) -> None:
    """Add the weight gradients of the micro-batch ``groups`` came from to each weight's ``.grad``."""
    for g in groups:
        edges, grads = [], []
        for n in g.frontier:
            for k, dy in enumerate(g.grads.get(n, ())):
                if dy is not None:
                    edges.append(GradientEdge(n, k))
                    grads.append(dy)
        if not edges:
            continue
        # A frontier node below another of the group would receive the upper one's gradient on top of the one
        # it recorded: it takes exactly the recorded one.
        clamps = [n.register_prehook(lambda _grads, saved=g.grads[n]: saved) for n in g.frontier
                  if n in g.grads] if len(g.frontier) > 1 else []
        ws = [weights[i] for i in g.weights]
        _accumulate(ws, _grad(clamps, edges, [GradientEdge(_accumulator(w), 0) for w in ws], grads))
