"""Schedule benchmark: what each pipeline schedule (1f1b, zb-h1, interleaved-1f1b with v = 2..4, zb-v) predicts on
the planner benchmark's clusters, for the MILP's groups re-cut into chunks (``hethub plan --schedule auto``).

Writes benchmarks/results/schedules.md. Run: python benchmarks/schedules.py [--quick]
Every number comes from this one run, on this machine. vs homog.: samples/s over the sum of the best single-type
sub-cluster plans, each also planned with ``--schedule auto`` (its own best schedule).
"""
import os
import sys
import time

from hethub.partitioner import builtin_model
from hethub.partitioner.api import homogeneous_plans, homogeneous_totals, make_plan
from hethub.partitioner.costmodel import CostModel, natural_dtype
from hethub.partitioner.planner import PlannerOptions
from hethub.partitioner.schedule_search import choose_schedule, search_schedule

sys.path.insert(0, os.path.dirname(__file__))
from planner import SUITE, inside_layers  # noqa: E402  (the planner benchmark's clusters)

ROWS = [SUITE[0], SUITE[2], SUITE[3]]  # 8 A100 + 8 V100 (batch 128), four types on 64, 768 devices (batch 1536)


def main():
    quick = "--quick" in sys.argv
    lines = []
    for name, cluster, model_name, batch, *limit in ROWS[:1] if quick else ROWS:
        model = builtin_model(model_name)
        dtype, _ = natural_dtype(cluster)  # as `hethub plan --dtype auto`: fp16 where a type lacks bf16 (V100)
        cm = CostModel(cluster, model, dtype=dtype)
        t0 = time.perf_counter()
        limit_s = limit[0] if limit else 60
        plan = make_plan(cluster, model, batch, opts=PlannerOptions(time_limit_s=limit_s,  # as --schedule auto
                                                                    schedule=search_schedule("auto")),
                         cost_model=cm, with_homogeneous_sum=False)
        best, tried = choose_schedule(plan, cm, "auto", replay_all=True)  # what every variant would take
        plan_s = time.perf_counter() - t0
        homog = homogeneous_plans(cm, batch, PlannerOptions(time_limit_s=30, schedule="auto"))
        total, _ = homogeneous_totals(homog.values())
        picks = ", ".join(f"{t} {p.schedule} v={p.num_chunks}" for t, p in homog.items() if p is not None)
        for sched, v, it, fits in sorted(tried, key=lambda x: x[2]):
            sps = batch / it
            replayed = plan.predicted.model_copy(update={"iteration_s": it})  # the variant's replay, above
            q = plan.model_copy(update={"schedule": sched, "predicted": replayed}) if v == 1 else None
            inside = inside_layers(q, cm, total) if q else "-"
            mark = " (chosen)" if (sched, v) == (best.schedule, best.num_chunks) else ""
            lines.append(f"| {name} | {dtype} | {batch} | {plan.num_stages} | {sched}{mark} | {v} | {it * 1e3:.1f} | {sps:.2f} | "
                         f"{sps / best.predicted.upper_bound_samples_per_s:.3f} | "
                         f"{sps / total:.3f} | {inside} | {'yes' if fits else 'no'} | {plan_s:.1f} | {plan.solver.gap:.2%} | "
                         f"{picks} |")
            print(lines[-1], flush=True)
    text = "\n".join([
        "# Schedule benchmark (this machine: 2 cores; HiGHS via PuLP; the MILP at 60 s, 10 s on the 768 row)", "",
        "The MILP plans one chunk per group (for zb-h1, as `hethub plan --schedule auto`); each schedule runs those groups, chunked schedules with the "
        "groups' layers re-cut into v chunks by time (`chunked.rechunk`); iteration from the event replay. "
        "efficiency: samples/s / pure-compute upper bound. vs homog.: samples/s / the sum of the best single-type "
        "sub-cluster plans, each with its own best schedule (listed). plan s: MILP + every variant's replay. dtype: "
        "as `hethub plan --dtype auto` (bf16 where every type has it, else fp16). zb-v's order is timed by its "
        "chunks' passes (`chunk_pass_ms`). vs homog. inside layers (one-chunk schedules): vs homog. if the "
        "groups could be cut inside a layer (`hethub plan --explain`'s layers line): what cutting only between "
        "layers costs the plan.", "",
        "| cluster | dtype | global batch | groups | schedule | v | ms/iteration | samples/s | efficiency | vs homog. "
        "| vs homog. inside layers | fits memory | plan s | MILP gap | homogeneous plans |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|", *lines, ""])
    os.makedirs("benchmarks/results", exist_ok=True)
    with open("benchmarks/results/schedules.md", "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
