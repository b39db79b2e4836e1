"""Where the benchmarks' tables go: benchmarks/results/NAME, written whole, and echoed on stdout."""
import os

from hethub.partitioner.outputs import write_atomic

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def write_result(name: str, text: str) -> None:
    os.makedirs(RESULTS, exist_ok=True)
    write_atomic(os.path.join(RESULTS, name), text, "results")
    print(text)
