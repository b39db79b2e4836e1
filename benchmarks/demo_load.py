"""``hethub demo`` on this machine idle and loaded: does its point hold? Three runs idle, then three with two busy
background processes (each a Python loop on one core), each run's speed-ups and prediction miss parsed from its
output. Writes benchmarks/results/demo_load.md. Targets: every run >= 1.2x over DeepSpeed's partition and >= 1.3x
over fastest-only, predicted within 15%.

Run: python benchmarks/demo_load.py [--runs N]
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.dirname(os.path.abspath(__file__))]
from results_io import write_result  # noqa: E402

BUSY = "import time\nwhile True:\n    sum(i * i for i in range(10000))\n"


def one_demo() -> dict:
    out = tempfile.mkdtemp(prefix="hethub-demo-")
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", PYTHONPATH=ROOT)
    r = subprocess.run([sys.executable, "-m", "hethub.cli", "demo", "-o", out], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=900)
    text = " ".join((r.stdout + r.stderr).split())
    if r.returncode != 0:
        raise SystemExit(f"demo failed:\n{text[-2000:]}")
    fast = re.search(r"hethub vs fastest-only: ([\d.]+)x measured \(([\d.]+)x predicted", text)
    ds = re.search(r"hethub vs DeepSpeed: ([\d.]+)x measured \(([\d.]+)x predicted", text)
    miss = re.search(r"predicted [\d,]+ ms \(([+-]\d+)%\)", text)
    load = re.search(r"load average ([\d.]+)", text)
    return {"fastest": float(fast.group(1)), "fastest_pred": float(fast.group(2)), "ds": float(ds.group(1)),
            "ds_pred": float(ds.group(2)), "miss_pct": int(miss.group(1)), "load": float(load.group(1))}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    a = ap.parse_args()
    rows = []
    for loaded in (False, True):
        busy = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(2 if loaded else 0)]
        try:
            for _ in range(a.runs):
                rows.append(("2 busy processes" if loaded else "idle", one_demo()))
        finally:
            for p in busy:
                p.kill()
    lines = ["| machine | load avg | vs DeepSpeed measured (predicted) | vs fastest-only measured (predicted) | "
             "hethub's iteration vs prediction |", "|---|---|---|---|---|"]
    for name, r in rows:
        lines.append(f"| {name} | {r['load']:.1f} | {r['ds']:.2f}x ({r['ds_pred']:.2f}x) | {r['fastest']:.2f}x "
                     f"({r['fastest_pred']:.2f}x) | {r['miss_pct']:+d}% |")
    ok = all(r["ds"] >= 1.2 and r["fastest"] >= 1.3 and abs(r["miss_pct"]) <= 15 for _, r in rows)
    text = ("# `hethub demo` idle and loaded (benchmarks/demo_load.py)\n\n"
            f"{len(rows)} runs of the embedded demo on this machine ({os.cpu_count()} cores), {a.runs} idle (other "
            f"work on the machine as it came) then {a.runs} with two busy Python processes beside it. Targets: "
            ">= 1.2x over DeepSpeed, >= 1.3x over fastest-only, predicted within 15%: "
            f"**{'met in every run' if ok else 'missed in some run'}**.\n\n" + "\n".join(lines) + "\n")
    write_result("demo_load.md", text)


if __name__ == "__main__":
    main()
