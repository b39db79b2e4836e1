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

The walk that finds the groups goes up from every weight; a chunk's graph is rebuilt each micro-batch but
its structure repeats, so ``WalkCache`` keeps the groups by node position and a micro-batch whose graph has
the same structure (one breadth-first pass compares it) skips the walk (0.43 of 2.45 ms of host time per
input pass on a 4-block llama stage, CPU).

Plain ``nn.Linear`` layers skip the graph: each autograd call carries a fixed cost, and a GPT block has
six Linears among its eight weight groups (a 5-block stage's split backward took 1.3x an unsplit one
with a call per group). ``LinearCalls`` records each call's input during the forward and its output
gradient during the input pass; the weight pass then computes dW = dY^T X and db = sum(dY) directly,
the same products, as Megatron's zero-bubble ``WeightGradStore`` does. A Linear whose weight is also
used outside its own calls (a tie, a direct use) is left to the graph: the weight's gradient node must
have exactly one consumer per recorded call.
"""
from __future__ import annotations

import itertools
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional, Sequence

import torch
from torch import nn
from torch.autograd.graph import GradientEdge
from torch.utils.checkpoint import CheckpointFunction

from .activations import pin, unpin
from .tp import is_dtensor


class SplitBackwardError(RuntimeError):
    """A stage whose backward cannot be split: weights that do not depend on its input (their gradients cannot
    wait for a weight pass), or reentrant activation checkpointing (an opaque node the input pass cannot enter)."""


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


@dataclass(eq=False)
class _Call:
    """One call of a plain Linear: its input, and the gradient its output receives in the input pass."""
    module: nn.Linear
    x: torch.Tensor
    dy: Optional[torch.Tensor] = None

    def record(self, grad: torch.Tensor) -> None:
        self.dy = grad

    def params(self) -> list[torch.Tensor]:
        return [p for p in (self.module.weight, self.module.bias) if p is not None and p.requires_grad]


def _plain_linear(m: nn.Module) -> bool:
    """A Linear whose forward is ``F.linear(x, weight, bias)`` on plain tensors (not a tensor-parallel DTensor)."""
    return (isinstance(m, nn.Linear) and type(m).forward is nn.Linear.forward
            and not any(is_dtensor(p) for p in (m.weight, m.bias) if p is not None))


class LinearCalls:
    """Records the plain ``nn.Linear`` calls of ``module``'s forwards made inside ``capturing()``."""

    def __init__(self, module: nn.Module):
        self._calls: Optional[list[_Call]] = None
        # prepend: this hook sees the Linear's own output, before any other hook replaces it
        self._handles = [m.register_forward_hook(self._hook, prepend=True) for m in module.modules()
                         if _plain_linear(m)]

    def _hook(self, module: nn.Linear, args: tuple, out) -> None:
        if (self._calls is None or not torch.is_grad_enabled() or not args or not torch.is_tensor(args[0])
                or not torch.is_tensor(out) or not out.requires_grad):
            return
        call = _Call(module, args[0])
        base = out._base if out._is_view() else None
        if base is not None and base.grad_fn is not None and base.numel() == out.numel():
            # a Linear over 3-D inputs returns a view of its 2-D product: a later in-place op on that view (a
            # block starting with ReLU(inplace=True)) rebases its history, and a hook on the view never fires.
            # The product's node still receives dY (flattened, as the weight pass uses it).
            base.grad_fn.register_prehook(lambda grads: call.record(grads[0]))
        else:
            out.register_hook(call.record)
        self._calls.append(call)

    @contextmanager
    def capturing(self) -> Iterator[list]:
        """The calls of the forward run inside, in a list returned at entry (filled as they happen)."""
        self._calls = calls = []
        try:
            yield calls
        finally:
            self._calls = None

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def _direct(calls: Sequence[_Call], consumers: dict) -> list[_Call]:
    """The calls whose layer's weights get gradients through these calls alone (one gradient consumer each)."""
    per_module: dict[int, list[_Call]] = {}
    for c in calls:
        per_module.setdefault(id(c.module), []).append(c)
    out = []
    for group in per_module.values():
        params = group[0].params()
        if params and all(len(consumers.get(_accumulator(p), ())) == len(group) for p in params):
            out += group
    return out


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


def _groups(consumers: dict, inputs: Sequence[torch.Tensor], weights: Sequence[torch.Tensor], stage: int,
            skip: frozenset = frozenset()) -> list[_Group]:
    """The weights' (but those whose id is in ``skip``) groups, by index into ``weights``."""
    on_input_path, _ = _upward([_node(x) for x in inputs], consumers)  # nodes whose backward reaches an input
    groups: list[_Group] = []
    owner: dict = {}  # frontier node -> its group
    lost = 0
    for i, w in enumerate(weights):
        if id(w) in skip:
            continue
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
    _refuse_lost(lost, stage)
    return groups


def _refuse_lost(lost: int, stage: int) -> None:
    if lost:
        raise SplitBackwardError(f"schedule zb-h1: {lost} weight(s) of stage {stage} do not depend on the stage's "
                                 f"input, so their gradients cannot be split from it; plan with --schedule 1f1b")


def _refuse_reentrant(nodes: Sequence, stage: int) -> None:
    """Reentrant activation checkpointing runs its segment's backward inside one opaque node, which
    ``torch.autograd.grad`` refuses to enter (torch raises mid-iteration): say so before, in one line."""
    if any(getattr(n, "_forward_cls", None) is CheckpointFunction for n in nodes):
        raise SplitBackwardError(
            f"schedule zb-h1: stage {stage} uses reentrant activation checkpointing (torch.utils.checkpoint with "
            f"use_reentrant=True), whose backward cannot be split; pass use_reentrant=False (Hugging Face: "
            f"gradient_checkpointing_kwargs={{'use_reentrant': False}}) or plan with --schedule 1f1b")


def _walk(roots: Sequence) -> tuple[list, tuple]:
    """The graph's nodes in discovery order, and its structure: each node's type and its children's positions.
    Two micro-batches of one chunk's forward build graphs of equal structure (new node objects), which is what
    lets ``WalkCache`` reuse the first one's groups by position."""
    order = list(roots)
    index = {n: i for i, n in enumerate(order)}
    shape = []
    for node in order:  # grows while read: a breadth-first walk
        kids = []
        for child, _ in node.next_functions:
            if child is None:
                kids.append(-1)
                continue
            if child not in index:
                index[child] = len(order)
                order.append(child)
            kids.append(index[child])
        shape.append((type(node), tuple(kids)))
    return order, tuple(shape)


@dataclass
class WalkCache:
    """One chunk's split of its backward, by node position, from the last micro-batch whose graph had this
    structure: the groups' walk (a walk up from every weight) runs once per structure, not per micro-batch
    (a chunk's graph is rebuilt each forward, but its structure repeats)."""
    key: Optional[tuple] = None
    direct: tuple = ()  # positions in the micro-batch's calls
    groups: tuple = ()  # (weight indices, frontier node positions) per group

    def lookup(self, key: tuple, order: list, calls: Sequence[_Call]) -> Optional[tuple[list, list]]:
        if key != self.key:
            return None
        return ([calls[i] for i in self.direct],
                [_Group(list(w), [order[i] for i in f]) for w, f in self.groups])

    def store(self, key: tuple, order: list, calls: Sequence[_Call], direct: list, groups: list) -> None:
        at = {n: i for i, n in enumerate(order)}
        self.key = key
        self.direct = tuple(i for i, c in enumerate(calls) if c in direct)
        self.groups = tuple((tuple(g.weights), tuple(at[n] for n in g.frontier)) for g in groups)


def _split(roots: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor], weights: Sequence[torch.Tensor],
           stage: int, calls: Sequence[_Call], cache: Optional[WalkCache]) -> tuple[list, list]:
    """(direct Linear calls, graph groups) of this backward, from ``cache`` when its structure repeats."""
    order, shape = _walk([r.grad_fn for r in roots])
    at = {n: i for i, n in enumerate(order)}
    key = (shape, tuple(at.get(_node(x), -1) for x in inputs),
           tuple(at.get(_accumulator(w), -1) for w in weights), tuple(id(c.module) for c in calls))
    hit = cache.lookup(key, order, calls) if cache is not None else None
    if hit is not None:
        return hit
    consumers = _consumers([r.grad_fn for r in roots])
    _refuse_reentrant([r.grad_fn for r in roots] + list(consumers), stage)
    direct = _direct(calls, consumers)
    groups = _groups(consumers, inputs, weights, stage, skip=frozenset(id(p) for c in direct for p in c.params()))
    if cache is not None:
        cache.store(key, order, calls, direct, groups)
    return direct, groups


@dataclass
class Pending:
    """What one micro-batch's weight pass resumes from: graph groups and directly computed Linear calls; ``pins``:
    what an active activation meter counts as held until the weight pass (``activations.pin``)."""
    groups: list[_Group]
    calls: list[_Call]
    pins: tuple = ()


def backward_input(roots: Sequence[torch.Tensor], root_grads: Optional[Sequence[torch.Tensor]],
                   inputs: Sequence[torch.Tensor], weights: Sequence[torch.Tensor], stage: int,
                   calls: Sequence[_Call] = (), cache: Optional[WalkCache] = None) -> Pending:
    """Input gradients of ``roots`` (the stage's outputs with their received gradients, or the loss with
    ``root_grads=None``), added to each input's ``.grad``; returns what ``backward_weight`` resumes from.
    ``calls``: this micro-batch's forward's plain Linear calls (``LinearCalls.capturing``), if recorded;
    ``cache``: the chunk's ``WalkCache``, kept by the caller across micro-batches."""
    direct, groups = _split(roots, inputs, weights, stage, calls, cache)
    records = [n.register_prehook(lambda grads, g=g, n=n: g.grads.__setitem__(n, grads))
               for g in groups for n in g.frontier]
    # the graph is kept only for the groups' weight pass; direct calls keep their own X and dY
    _accumulate(inputs, _grad(records, list(roots), list(inputs), root_grads, retain_graph=bool(groups)))
    _refuse_lost(len({id(p) for c in direct if c.dy is None for p in c.params()}), stage)  # off the input's path
    held = itertools.chain((t for c in direct for t in (c.x, c.dy)),
                           (t for g in groups for ts in g.grads.values() for t in ts))  # read only under a meter
    return Pending(groups, direct, pin(held))


def _grad(hooks: list, outputs, inputs, grads, **kw):
    """``torch.autograd.grad`` with ``hooks`` (pre-hook handles) in place for it, removed after it."""
    try:
        return torch.autograd.grad(outputs, inputs, grads, allow_unused=True, **kw)
    finally:
        for h in hooks:
            h.remove()


def _accumulate(tensors: Sequence[torch.Tensor], grads) -> None:
    """Add each gradient to its tensor's ``.grad``, as autograd's accumulation would (recording nothing: a
    ``.grad`` may be a view of the all-reduce's bucket, ``hethub.runtime.buckets``)."""
    with torch.no_grad():
        for t, g in zip(tensors, grads):
            if g is None:
                continue
            if t.grad is None:
                t.grad = g
            else:
                t.grad.add_(g)


class _Uses:
    """How many accumulations into each weight a weight pass still has to do: ``on_ready`` hears of a weight as
    soon as its last one is done (the gradient all-reduce's buckets start from it), and of the rest at the end."""

    def __init__(self, weights: Sequence[torch.Tensor], pending: Pending,
                 on_ready: Optional[Callable[[list], None]]):
        self.on_ready, self.left, self.by_id = on_ready, Counter(), {}
        for c in pending.calls:
            for t in (c.module.weight, c.module.bias):
                if t is not None and t.requires_grad:
                    self.left[id(t)] += 1
                    self.by_id[id(t)] = t
        for g in pending.groups:
            for i in g.weights:
                self.left[id(weights[i])] += 1
                self.by_id[id(weights[i])] = weights[i]

    def add(self, tensors: Sequence[torch.Tensor], grads) -> None:
        _accumulate(tensors, grads)
        done = []
        for t in tensors:
            self.left[id(t)] -= 1
            if self.left[id(t)] == 0:
                done.append(t)
        if done and self.on_ready is not None:
            self.on_ready(done)

    def flush(self) -> None:
        rest = [self.by_id[k] for k, n in self.left.items() if n > 0]
        if rest and self.on_ready is not None:
            self.on_ready(rest)


def backward_weight(weights: Sequence[torch.Tensor], pending: Pending,
                    on_ready: Optional[Callable[[list], None]] = None) -> None:
    """Add the weight gradients of the micro-batch ``pending`` came from to each weight's ``.grad``; ``on_ready``
    is told of each weight whose gradient this pass has finished."""
    uses = _Uses(weights, pending, on_ready)
    with torch.no_grad():  # X is part of the forward's graph: a product recorded on it would keep that graph alive
        for c in pending.calls:  # dW = dY^T X, db = sum(dY), in the dtype the forward ran in (autocast's)
            dy = c.dy.reshape(-1, c.dy.shape[-1])
            x = c.x.reshape(-1, c.x.shape[-1]).to(dy.dtype)
            w, b = c.module.weight, c.module.bias
            if w.requires_grad:
                uses.add([w], [dy.t().mm(x).to(w.dtype)])
            if b is not None and b.requires_grad:
                uses.add([b], [dy.sum(0).to(b.dtype)])
    for g in pending.groups:
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
        uses.add(ws, _grad(clamps, edges, [GradientEdge(_accumulator(w), 0) for w in ws], grads))
    uses.flush()
    unpin(pending.pins)
