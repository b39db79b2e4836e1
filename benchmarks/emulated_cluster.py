"""The emulated cluster's link latency, measured: what one of hethub's point-to-point transfers takes on this
machine from the moment its send is posted until the receiving rank's main thread holds the data.

Why: an emulated cluster is a set of processes on one CPU box talking gloo over loopback, and its cluster file
should say what that network costs, as a real cluster's says what its fabric costs. The default latencies (5 us
within a node, 20 us across) describe a GPU fabric; here a transfer passes gloo's TCP loopback and the runtime's
lane threads (``hethub.runtime.ordered``), a few hundred microseconds. Measured as a token passed around a ring of
``world`` ranks (each receive through the runtime's ``OrderedGroups``, each rank idling a little between hops as
an emulated device does): the median over rounds of a round's time / world. Idle ranks wake faster than ranks
sharing the cores with others' compute, so under a benchmark's load transfers take longer than this.

Run alone: python benchmarks/link_latency.py [WORLD]  (prints the median hop in microseconds)
"""
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROUNDS, WARMUP = 60, 10


def _worker(out: str) -> None:
    import torch
    import torch.distributed as dist

    sys.path.insert(0, ROOT)
    from hethub.runtime.errors import Guard
    from hethub.runtime.ordered import OrderedGroups

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ops = OrderedGroups(Guard(rank, 0, world, lambda: 0), strict=lambda group: True)
    token = torch.zeros(2 * 64 * 192)  # one of the fidelity plans' activations (2 rows x seq 64 x hidden 192)
    prev, nxt = (rank - 1) % world, (rank + 1) % world
    hops = []
    for i in range(ROUNDS):
        dist.barrier()
        t0 = time.perf_counter()
        if rank != 0:
            ops.wait(ops.issue(None, lambda: dist.irecv(token, prev)))
            time.sleep(0.0002)  # an emulated device's idle before its next send
        ops.wait(ops.issue(None, lambda: dist.isend(token, nxt)))
        if rank == 0:
            ops.wait(ops.issue(None, lambda: dist.irecv(token, prev)))
            if i >= WARMUP:
                hops.append((time.perf_counter() - t0) / world - 0.0002 * (world - 1) / world)
    if rank == 0:
        with open(out, "w", encoding="utf-8") as f:
            json.dump({"hop_us": statistics.median(hops) * 1e6}, f)
    dist.destroy_process_group()


def measure_hop_us(world: int, port: int = 29650) -> float:
    """Median microseconds of one transfer hop among ``world`` ranks on this machine (see the module's doc)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "hop.json")
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world), "--master_port",
               str(port), os.path.abspath(__file__), "--worker", out]
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        if r.returncode != 0:
            raise SystemExit("link latency run failed:\n" + (r.stdout + r.stderr)[-3000:])
        with open(out, encoding="utf-8") as f:
            return json.load(f)["hop_us"]


def with_latency(cluster: dict, hop_us: float) -> dict:
    """A cluster description (dict) whose links take ``hop_us`` of latency, within a node and across."""
    return {**cluster, "network": {**cluster["network"], "intra_node_latency_us": round(hop_us, 1),
                                   "inter_node_latency_us": round(hop_us, 1)}}


if __name__ == "__main__":
    if "--worker" in sys.argv:
        _worker(sys.argv[sys.argv.index("--worker") + 1])
    else:
        print(f"{measure_hop_us(int(sys.argv[1]) if len(sys.argv) > 1 else 6):.1f}")
