"""Two ranks exchange stage-boundary-like messages through hethub's ordered transport (hethub.runtime.ordered).

    ordered_pair.py one|two

Rank 0 posts ``send A0, recv G0, send A1``, rank 1 ``recv A0, recv A1, send G0`` (what 1F1B posts at a
boundary), all on one gloo group (``one``) or with the gradient on a group of its own (``two``). Held to issue
order per group, as NCCL holds them, ``one`` deadlocks: each rank ends at the timeout with one line naming its
peer (exit 3); ``two`` completes and prints the values received.
"""
import datetime
import sys

import torch
import torch.distributed as dist

from hethub.runtime.errors import Guard
from hethub.runtime.ordered import OrderedGroups


def main() -> None:
    mode = sys.argv[1]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=5))
    rank = dist.get_rank()
    timeout = datetime.timedelta(seconds=5)
    fwd = dist.new_group([0, 1], backend="gloo", timeout=timeout)
    bwd = fwd if mode == "one" else dist.new_group([0, 1], backend="gloo", timeout=timeout)
    guard = Guard(rank, rank, 2, lambda: 0)
    guard.watch([1 - rank], "the toy exchange")
    ops = OrderedGroups(guard, strict=lambda group: True)
    a0, a1, g0 = torch.full((4,), 10.0), torch.full((4,), 11.0), torch.full((4,), 20.0)
    if rank == 0:
        got = torch.zeros(4)
        ops.issue(fwd, lambda: dist.isend(a0, 1, group=fwd))
        recv = ops.issue(bwd, lambda: dist.irecv(got, 1, group=bwd))
        ops.issue(fwd, lambda: dist.isend(a1, 1, group=fwd))
        ops.wait(recv)
        received = [got]
    else:
        r0, r1 = torch.zeros(4), torch.zeros(4)
        ops.issue(fwd, lambda: dist.irecv(r0, 0, group=fwd))
        last = ops.issue(fwd, lambda: dist.irecv(r1, 0, group=fwd))
        ops.wait(last)
        ops.issue(bwd, lambda: dist.isend(g0, 0, group=bwd))
        received = [r0, r1]
    ops.wait_all()
    print("received", [float(t[0]) for t in received], flush=True)
    dist.barrier()


if __name__ == "__main__":
    main()
