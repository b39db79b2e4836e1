"""What an emulated cluster's hardware does, measured on this machine, for its cluster file: link latency and the
memory bandwidth its optimizer steps see.

Why: an emulated cluster is a set of processes on one CPU box, and its cluster file should say what that hardware
does, as a real cluster's says what its fabric and memory do. The cost model prices two things from the file that
the emulation does not slow: transfer latency and the optimizer step.

- Link latency: what one of hethub's point-to-point transfers takes from the moment its send is posted until the
  receiving rank's main thread holds the data: gloo's TCP loopback and the runtime's lane threads
  (``hethub.runtime.ordered``), not a GPU fabric's 5-20 us. Measured as a pipeline's transfers meet it: ``world``
  ranks in pairs each run emulated passes (``ROUND_S``, a ``BUSY_SHARE`` of it real compute, the rest idle);
  after each pass the pair's receiver says it is ready and waits, and its sender writes its clock (one monotonic
  clock per machine) into an activation-sized message, posts it through the runtime's ``OrderedGroups`` and goes
  on with its next pass, as a stage does after a forward; the receiver takes the difference. The median over
  rounds and pairs: 1.4-1.9 ms here, as the lane thread that sends shares the process with a computing main
  thread. Measured with the sender idle until its send completed (a token passed around a ring), it was 0.26 ms,
  and the chunked schedules, whose critical path crosses a boundary at every chunk, were predicted up to 13.5% fast.
- Optimizer memory bandwidth: every rank steps its optimizer at the same time (after the last backward), at this
  CPU's real speed, all ``world`` of them on the machine's cores. Measured so: ``world`` ranks each step Adam over
  the same parameter count at once; the bandwidth is the cost model's bytes of that step (``state_bytes_of`` x
  ``OPTIMIZER_PASSES``) over the median step time.

Run alone: python benchmarks/emulated_cluster.py [WORLD]  (prints both)
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
# the hop run's ranks work as a pipeline's emulated ranks do: a pass of about a one-layer chunk's forward on a FAST
# rank, a sixth of it real compute (FAST is emulated 6x slower than this CPU), the rest idle
ROUND_S, BUSY_SHARE = 0.012, 1 / 6
OPT_PARAMS, OPT_STEPS = 1 << 20, 15  # about one fidelity stage's parameters (two blocks of hidden 192)


def _hop_worker(out: str) -> None:
    import torch
    import torch.distributed as dist

    from hethub.runtime.errors import Guard
    from hethub.runtime.ordered import OrderedGroups

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ops = OrderedGroups(Guard(rank, 0, world, lambda: 0), strict=lambda group: True)
    # one of the fidelity plans' activations (2 rows x seq 64 x hidden 192 in fp32), as float64 to carry a clock
    data, ready = torch.zeros(64 * 192, dtype=torch.float64), torch.zeros(1)
    a, b = torch.randn(128, 192), torch.randn(192, 768)
    peer = rank ^ 1 if rank ^ 1 < world else None  # pairs (0, 1), (2, 3), ...; an odd world's last rank only works
    hops, sent = [], None
    for i in range(ROUNDS + WARMUP):
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < ROUND_S * BUSY_SHARE:  # an emulated pass: real work, then idle
            torch.mm(a, b)
        time.sleep(max(0.0, t0 + ROUND_S - time.perf_counter()))
        if peer is None:
            continue
        if rank % 2:  # the receiver says it is ready and waits: what a stage with its receive posted does
            ops.wait(ops.issue(None, lambda: dist.isend(ready, peer)))
            ops.wait(ops.issue(None, lambda: dist.irecv(data, peer)))
            if i >= WARMUP:  # the sender's clock (CLOCK_MONOTONIC, one per machine) to this rank's
                hops.append(time.perf_counter() - float(data[0]))
        else:  # the sender posts and works on, as the runtime's sends leave while the next pass runs
            if sent is not None:
                ops.wait(sent)
            ops.wait(ops.issue(None, lambda: dist.irecv(ready, peer)))
            data[0] = time.perf_counter()
            sent = ops.issue(None, lambda: dist.isend(data, peer))
    if sent is not None:
        ops.wait(sent)
    mine = torch.tensor([statistics.median(hops) if hops else 0.0, float(bool(hops))], dtype=torch.float64)
    dist.all_reduce(mine)
    if rank == 0:
        with open(out, "w", encoding="utf-8") as f:
            json.dump({"hop_us": float(mine[0] / mine[1]) * 1e6}, f)
    dist.destroy_process_group()


def _adam_worker(out: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    params = [torch.nn.Parameter(torch.randn(OPT_PARAMS // 4)) for _ in range(4)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.Adam(params, lr=1e-3)
    steps = []
    for i in range(OPT_STEPS):
        dist.barrier()  # every rank steps at once, as after a pipeline's last backward
        t0 = time.perf_counter()
        opt.step()
        if i >= 3:
            steps.append(time.perf_counter() - t0)
    if dist.get_rank() == 0:
        with open(out, "w", encoding="utf-8") as f:
            json.dump({"step_s": statistics.median(steps)}, f)
    dist.destroy_process_group()


def _launch(world: int, what: str, port: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world), "--master_port",
               str(port), os.path.abspath(__file__), "--worker", what, out]
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        if r.returncode != 0:
            raise SystemExit(f"{what} run failed:\n" + (r.stdout + r.stderr)[-3000:])
        with open(out, encoding="utf-8") as f:
            return json.load(f)


def measure_hop_us(world: int, port: int = 29650) -> float:
    """Median microseconds of one transfer hop among ``world`` ranks on this machine (see the module's doc)."""
    return _launch(world, "hop", port)["hop_us"]


def measure_optimizer_gbps(world: int, port: int = 29651) -> float:
    """GB/s of the cost model's optimizer step (fp32 Adam) when ``world`` ranks step at once (the module's doc)."""
    from hethub.partitioner import Cluster, ModelConfig
    from hethub.partitioner.costmodel import OPTIMIZER_PASSES, CostModel
    from hethub.cli.demo import DEMO_CLUSTER, DEMO_MODEL
    cm = CostModel(Cluster.model_validate(DEMO_CLUSTER), ModelConfig.model_validate(DEMO_MODEL), dtype="fp32")
    return cm.state_bytes_of(OPT_PARAMS) * OPTIMIZER_PASSES / _launch(world, "adam", port)["step_s"] / 1e9


def measured(cluster: dict, world: int) -> dict:
    """A cluster description (dict) with this machine's link latency (within a node and across) and optimizer
    bandwidth (every device type) for ``world`` emulated ranks."""
    hop_us, gbps = measure_hop_us(world), measure_optimizer_gbps(world)
    types = {t: {**spec, "memory_gbps": round(gbps, 2)} for t, spec in cluster["device_types"].items()}
    return {**cluster, "device_types": types,
            "network": {**cluster["network"], "intra_node_latency_us": round(hop_us, 1),
                        "inter_node_latency_us": round(hop_us, 1)}}


if __name__ == "__main__":
    if "--worker" in sys.argv:
        sys.path.insert(0, ROOT)
        what, out = sys.argv[sys.argv.index("--worker") + 1:][:2]
        (_hop_worker if what == "hop" else _adam_worker)(out)
    else:
        w = int(sys.argv[1]) if len(sys.argv) > 1 else 6
        print(f"link latency {measure_hop_us(w):.1f} us, optimizer {measure_optimizer_gbps(w):.2f} GB/s")
