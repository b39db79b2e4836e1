"""Writing a checkpoint: a snapshot taken at the step, its files written by a thread, published once all are done.

Why in three parts: what needs the other ranks (a tensor-parallel layer gathered whole, ZeRO-1's shards gathered)
and the copy of this rank's part into host memory must happen at the step, in the training thread, while the
weights are those of that step. What is slow and needs no one (serialising, hashing, writing) runs in a thread
while training goes on (``background``). The checkpoint becomes complete only when rank 0 renames it into place,
which it does in the training thread once every rank said its files are written: one small all-reduce at the end
of the next step (``poll``). A write gets that step to run in the background; what is left of it the step's end
waits for, so a checkpoint taken at step k is complete once step k + 1 is, on every run. One still being written
when a host dies is never complete: a restart resumes from the one before, losing at most the interval plus one
step.

Cost: while a write is in flight, host memory for one copy of what this rank writes (its stage's weights and
optimizer state on the replica that writes them), as torch's ``async_save`` keeps.

Each writer (the lead rank of each stage's first replica) writes ``.written-<rank>.json`` (its files' sha256, or
the error it met) beside its files; rank 0 merges them into ``meta.json``.
"""
from __future__ import annotations

import atexit
import json
import os
import shutil
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from ..partitioner.errors import InputError
from ..partitioner.outputs import write_atomic
from ..partitioner.provenance import sha256_file
from . import errors
from .checkpoint import (FORMAT_VERSION, LATEST, CheckpointParts, agree, checked_tag, layer_file, param_names,
                         tie_owners)
from .precision import scaler_state
from .tp import from_local, full, gather_like, is_dtensor, local

_WRITTEN = ".written-{rank}.json"
_WAIT_AT_EXIT_POLL_S = 0.05


@dataclass
class Pending:
    """One checkpoint being written: where, by whom, and (rank 0) its meta.json without the digests."""
    save_dir: str
    tag: str
    writers: tuple[int, ...]  # ranks that write files (and a .written-<rank>.json)
    rank: int
    wait_s: float  # at exit: how long rank 0 waits for the other writers before giving up on this checkpoint
    meta: Optional[dict] = None
    error: Optional[str] = None  # what this rank's write met, if anything
    thread: Optional[threading.Thread] = field(default=None, repr=False)

    @property
    def tmp(self) -> str:
        return os.path.join(self.save_dir, f".tmp-{self.tag}")

    @property
    def final(self) -> str:
        return os.path.join(self.save_dir, self.tag)

    def done(self) -> bool:
        return self.thread is None or not self.thread.is_alive()


class Saver:
    """This rank's checkpoint writes: at most one in flight (``pending``), completed in step order. The engine
    holds one and hands it the parts a checkpoint reads (``checkpoint.CheckpointParts``) at each call."""

    def __init__(self):
        self.pending: Optional[Pending] = None

    def save(self, parts: CheckpointParts, save_dir: str, tag: Optional[str] = None,
             client_state: Optional[dict] = None, background: bool = False) -> str:
        """Collective: every rank calls it. Without ``background`` it returns once the checkpoint is complete; with
        it, once this rank's snapshot is taken (``poll`` at each step's end completes it). Returns the tag."""
        self.poll(parts, wait=True)  # a write still in flight finishes first: checkpoints complete in step order
        job = _prepare(parts, save_dir, tag, client_state)
        files = _snapshot(parts)
        if job.rank in job.writers:  # the others have nothing to write: their part is done
            job.thread = threading.Thread(target=_write, args=(job, files), name=f"hethub-checkpoint-{job.tag}",
                                          daemon=True)
            job.thread.start()
        self.pending = _LAST[0] = job
        if not background:
            self.poll(parts, wait=True)
        return job.tag

    def poll(self, parts: CheckpointParts, wait: bool = False) -> bool:
        """Collective while a write is in flight: when every rank's part is written, rank 0 publishes the
        checkpoint (``wait``: waits for this rank's part first). Any rank's write error ends every rank with one
        line. Returns whether no write is in flight any more."""
        job = self.pending
        if job is None:
            return True
        if wait and job.thread is not None:
            job.thread.join()
        world = parts.plan.world_size
        done, failed = parts.control.min([int(job.done()), parts.rank if job.done() and job.error else world])
        if failed < world:
            errors.fail(job.error or f"checkpoint: rank {failed} could not write its part of {job.tag!r} (see its "
                                     "message)")
        if not done:
            return False
        error = None
        if parts.rank == 0:
            try:
                _publish(job)
            except OSError as exc:
                error = f"checkpoint: cannot finish {job.final[:100]!r}: {exc.strerror or type(exc).__name__}"
            except InputError as exc:  # a writer's record, or the atomic write of `latest`
                error = str(exc)
        agree(parts, error, "could not finish the checkpoint")
        self.pending = _LAST[0] = None
        return True


def _prepare(parts: CheckpointParts, save_dir: str, tag: Optional[str], client_state: Optional[dict]) -> Pending:
    """Collective: the temporary folder exists and every rank sees it; rank 0 holds meta.json's fields."""
    tag = checked_tag(save_dir, tag or f"global_step{parts.counters.global_steps}")
    rank = parts.rank
    job = Pending(save_dir, tag, tuple(sorted({st.replicas[0].rank for st in parts.plan.stages})), rank,
                  parts.control.timeout_s)
    error = None
    if rank == 0:
        try:
            os.makedirs(save_dir, exist_ok=True)
            if os.path.exists(job.tmp):
                shutil.rmtree(job.tmp)
            os.makedirs(job.tmp)
        except OSError as exc:
            error = f"checkpoint: cannot make {job.tmp[:100]!r}: {exc.strerror or type(exc).__name__}"
        job.meta = _meta(parts, client_state)
    agree(parts, error, "cannot make the checkpoint directory")  # also the barrier: tmp exists from here on
    agree(parts, None if os.path.isdir(job.tmp) else
          f"checkpoint: {save_dir[:100]!r} is not shared by every host: rank {rank} (host {_host(parts)}) cannot "
          "see the directory rank 0 made there; save to a filesystem every host mounts",
          "cannot see the checkpoint directory")
    return job


def _snapshot(parts: CheckpointParts) -> dict[str, Any]:
    """Collective over each stage: file name -> what this rank writes, copied into host memory (training changes
    the weights and optimizer state in place from the next step on)."""
    per_layer_state = _optimizer_state_by_layer(parts)
    files: dict[str, Any] = {}
    if parts.grid.replica_id != 0:
        return files
    owners = tie_owners(parts)
    for idx, layer in parts.module.indexed_layers():
        whole = {k: _host_copy(full(v)) for k, v in layer.state_dict(keep_vars=True).items() if (idx, k) not in owners}
        if parts.grid.tp_rank == 0:  # every rank of a tensor-parallel group gathers, its lead writes
            files[os.path.basename(layer_file("", idx, "model"))] = whole
            files[os.path.basename(layer_file("", idx, "optim"))] = per_layer_state.get(idx, {})
    return files


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", copy=True)


def _write(job: Pending, files: dict[str, Any]) -> None:
    """The thread of a writer: its files, then its record of their digests (or of the error it met)."""
    digests: dict[str, str] = {}
    try:
        for name, obj in files.items():
            path = os.path.join(job.tmp, name)
            torch.save(obj, path)
            digests[name] = sha256_file(path)
    except OSError as exc:  # disk full, quota: the checkpoint is never published, the previous one stays intact
        job.error = f"checkpoint: cannot write in {job.tmp[:100]!r}: {exc.strerror or type(exc).__name__}"
    try:
        record = {"error": job.error} if job.error else {"digests": digests}
        write_atomic(os.path.join(job.tmp, _WRITTEN.format(rank=job.rank)), json.dumps(record), "checkpoint")
    except (OSError, InputError) as exc:
        job.error = job.error or f"checkpoint: cannot write in {job.tmp[:100]!r}: {exc}"


def _records(job: Pending) -> dict[str, str]:
    """Every writer's digests, merged (each written before its rank said it was done)."""
    digests: dict[str, str] = {}
    for rank in job.writers:
        path = os.path.join(job.tmp, _WRITTEN.format(rank=rank))
        try:
            with open(path, encoding="utf-8") as f:
                record = json.load(f)
        except (OSError, ValueError) as exc:
            raise InputError("checkpoint", f"rank {rank}'s record of its files ({path[:160]}) is unreadable "
                                           f"({type(exc).__name__})") from None
        if not isinstance(record, dict) or "error" in record or not isinstance(record.get("digests"), dict):
            raise InputError("checkpoint", f"rank {rank} did not write its part of {job.tag!r}: "
                                           f"{str(record.get('error') if isinstance(record, dict) else record)[:200]}")
        digests.update(record["digests"])
        os.remove(path)
    return digests


def _publish(job: Pending) -> None:
    """Rank 0, once every writer is done: meta.json, then the rename that makes the checkpoint complete, then
    ``latest`` (a crash anywhere in between leaves the previous checkpoint and ``latest`` intact)."""
    meta = dict(job.meta, digests=dict(sorted(_records(job).items())))
    with open(os.path.join(job.tmp, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1)
    _fsync_dir(job.tmp)
    if os.path.exists(job.final):
        shutil.rmtree(job.final)
    os.rename(job.tmp, job.final)
    write_atomic(os.path.join(job.save_dir, LATEST), job.tag, "checkpoint")


def _fsync_dir(path: str) -> None:
    for root, _dirs, files in os.walk(path):
        for f in files:
            with open(os.path.join(root, f), "rb") as fh:
                os.fsync(fh.fileno())


def _meta(parts: CheckpointParts, client_state: Optional[dict]) -> dict:
    """meta.json's fields at the step (the digests are added when the files are written)."""
    plan = parts.plan
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in parts.optimizer.param_groups]
    return {"format": "hethub-layer-checkpoint", "version": FORMAT_VERSION, "model": plan.model.model_dump(),
            "global_steps": parts.counters.global_steps, "global_samples": parts.counters.global_samples,
            "optimizer": type(parts.optimizer).__name__, "param_groups": _jsonable(hyper[:1]),
            "lr_scheduler": _jsonable(parts.lr_scheduler.state_dict()) if parts.lr_scheduler else None,
            "client_state": _jsonable(client_state or {}),
            "loss_scaler": scaler_state(parts.loss_scaler),
            "skipped_steps": parts.counters.skipped_steps,
            "ties": [[list(p) for p in tie.places] for tie in parts.ties],
            "plan": {"stages": [[*(s.layers or ()), s.device_type, s.width] if s.chunks is None else
                                [[list(c) for c in s.chunks], s.device_type, s.width] for s in plan.stages],
                     "world_size": plan.world_size}}


def _jsonable(x):
    return json.loads(json.dumps(x, default=lambda o: o.tolist() if torch.is_tensor(o) else str(o)))


def _host(parts: CheckpointParts) -> str:
    stage, replica = parts.plan.locate(parts.rank)
    return parts.plan.stages[stage].replicas[replica].host


# ---------------------------------------------------------------------------------------------- optimizer state
def _optimizer_state_by_layer(parts: CheckpointParts) -> dict[int, dict[str, Any]]:
    """layer index -> parameter name -> the optimizer's full state (host copies) of each of this stage's
    parameters. Collective over the stage's replicas under ZeRO-1 (every replica's elements are gathered)."""
    names = param_names(parts)
    opt = parts.optimizer
    out: dict[int, dict[str, Any]] = {}
    owners = tie_owners(parts)
    # Only the writer (replica 0's lead) copies to the host: the others take part in the gathers and drop the result
    writes = parts.grid.replica_id == 0 and parts.grid.tp_rank == 0
    to_host = _host_copy if writes else (lambda t: t)

    def put(p, st, made_whole=False):
        idx, name = names[id(p)]
        if (idx, name) in owners:
            return  # a tied weight's state is stored with its first layer, by the stage holding that
        if not made_whole:
            st = {k: (to_host(_whole_state(p, v)) if torch.is_tensor(v) else v) for k, v in st.items()}
        if writes:
            out.setdefault(idx, {})[name] = st

    if parts.zero1 is not None:
        for shard in parts.zero1.shards:  # (a stage mixing degrees shards whole tensors: gathered whole already)
            for p, st in zip(shard.params, _gathered_state(parts, shard, to_host)):
                put(p, st, made_whole=shard.whole)
        return out
    for group in opt.param_groups:
        for p in group["params"]:
            if id(p) in names and p in opt.state:
                put(p, opt.state[p])
    return out


def _whole_state(p: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """An optimizer state tensor of parameter ``p`` made whole: a tensor-parallel parameter's state is its
    shard (a DTensor, a marked plain tensor, or under ZeRO-1 a plain tensor shaped like the shard), gathered
    over the group (collective: every rank of the group calls it, in the same order)."""
    if is_dtensor(v):
        return full(v)
    if is_dtensor(p) and v.dim() > 0 and tuple(v.shape) == tuple(local(p).shape):
        return full(from_local(v, p))
    return gather_like(v, p)


def _gathered_state(parts: CheckpointParts, shard, to_host: Callable) -> list[dict]:
    """ZeRO-1: the full per-parameter state of one flat shard, every replica's elements all-gathered (tensors
    only, in hethub's own collectives: nothing is pickled). Per-element state (shaped like the shard) is
    gathered; 0-d state such as Adam's step is the same on every replica and copied to each parameter."""
    st = parts.optimizer.state.get(shard.shard, {})
    # Every replica steps its shard at the same steps, so all hold the same keys (an empty shard too).
    keys = sorted(k for k, v in st.items() if torch.is_tensor(v) and v.dim() > 0)
    gathered = {}
    for k in keys:
        padded = torch.zeros(shard.chunk, dtype=st[k].dtype, device=st[k].device)
        padded[:st[k].numel()].copy_(st[k].reshape(-1))
        gathered[k] = to_host(parts.gradients.all_gather_stage(padded, "the ZeRO-1 checkpoint gather")[:shard.total])
    scalars = {k: v for k, v in st.items() if k not in gathered}
    return shard.split_state(gathered, scalars) if st else []


# ---------------------------------------------------------------------------------------------- at exit
_LAST: list[Optional[Pending]] = [None]  # this process's write in flight, for the exit hook


def _finish_at_exit() -> None:
    """A write still in flight when the script ends (its last autosave): each rank's thread finishes its files and
    rank 0 publishes once every writer's record is there (bounded by the run's timeout, without collectives: the
    process groups may be gone). Not after a failure: the rank ends at once, the checkpoint stays incomplete."""
    job = _LAST[0]
    if job is None or errors.ending():
        return
    if job.thread is not None:
        job.thread.join()
    if job.rank != 0:
        return
    deadline = time.monotonic() + job.wait_s
    missing = list(job.writers)
    while missing and time.monotonic() < deadline:
        missing = [r for r in missing if not os.path.exists(os.path.join(job.tmp, _WRITTEN.format(rank=r)))]
        if missing:
            time.sleep(_WAIT_AT_EXIT_POLL_S)
    try:
        if missing:
            raise InputError("checkpoint", f"ranks {', '.join(map(str, missing[:8]))} did not finish writing "
                                           f"within {job.wait_s:g} s")
        _publish(job)
    except (OSError, InputError) as exc:
        sys.stderr.write(f"hethub: checkpoint {job.tag!r} was still being written at exit and is left incomplete "
                         f"({exc}); the newest complete one in {job.save_dir[:100]} is kept\n")
        sys.stderr.flush()


atexit.register(_finish_at_exit)
