"""Sailor's measured OPT-350M profiles as hethub profiles: the peers benchmark priced as Sailor prices it.

Sailor (SOSP'25, github.com/eth-easl/sailor) ships per-layer times it measured for OPT-350M on each GPU type, one
``profile.json`` per type under ``sailor/Planner/sailor_planner/profiles/OPT-350/<type>/``: for each micro-batch
size, each tensor-parallel degree and each of the 26 layers (embedding, 24 blocks, head), the forward, backward
and optimizer-step seconds. This writes one hethub profile per (type, micro-batch size, degree) of the two types
the benchmark's cases use, forward and backward in milliseconds (the optimizer step is the cost model's own), fp16.
The numbers stay in Sailor's repository: point this at a checkout.

Run: python benchmarks/sailor_profiles.py SAILOR_CHECKOUT OUT_DIR
     python benchmarks/peers.py --profiles OUT_DIR --out peers-sailor.md
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from peers import OPT_350M  # noqa: E402

from hethub.partitioner.errors import InputError  # noqa: E402
from hethub.partitioner.outputs import write_atomic  # noqa: E402
from hethub.partitioner.records import Profile  # noqa: E402

TYPES = {"A100-40": "A100-40GB", "V100-16": "V100-16GB"}  # Sailor's name -> the benchmark cluster's
PROFILES = os.path.join("sailor", "Planner", "sailor_planner", "profiles", "OPT-350")
MAX_BYTES = 4 << 20  # a profile.json is ~40 KB
MIN_MS = 1e-3  # Sailor writes a 3-microsecond backward for the embedding; hethub's times are never 0


def _read(path: str) -> dict:
    if not os.path.isfile(path):
        raise InputError("sailor checkout", f"no profile at {path!r}")
    if os.path.getsize(path) > MAX_BYTES:
        raise InputError(path, f"{os.path.getsize(path)} bytes; a Sailor profile is under {MAX_BYTES} bytes")
    with open(path) as f:
        return json.load(f)


def layer_rows(layers: dict, where: str) -> list[dict]:
    """Sailor's {layer index: [forward s, backward s, update s]} as hethub's layer records."""
    kinds = [li.kind for li in OPT_350M.layers()]
    if sorted(int(k) for k in layers) != list(range(len(kinds))):
        raise InputError(where, f"expected layers 0..{len(kinds) - 1} (OPT-350M), got {sorted(layers)[:8]}")
    rows = []
    for i in range(len(kinds)):
        times = layers[str(i)]
        if not (isinstance(times, list) and len(times) >= 2 and all(isinstance(x, (int, float)) for x in times[:2])):
            raise InputError(f"{where}[{i}]", f"expected [forward s, backward s, ...], got {str(times)[:60]}")
        rows.append({"index": i, "kind": kinds[i], "forward_ms": max(times[0] * 1e3, MIN_MS),
                     "backward_ms": max(times[1] * 1e3, MIN_MS)})
    return rows


def convert(checkout: str, out_dir: str) -> list[str]:
    """Every (type, micro-batch size, degree) of the two types, written under out_dir; the files' names."""
    os.makedirs(out_dir, exist_ok=True)
    written = []
    for sailor_name, device_type in TYPES.items():
        path = os.path.join(checkout, PROFILES, sailor_name, "profile.json")
        data = _read(path)
        for mbs, by_degree in sorted(data.items(), key=lambda kv: int(kv[0])):
            for tp, layers in sorted(by_degree.items(), key=lambda kv: int(kv[0])):
                where = f"{path}[{mbs}][{tp}]"
                profile = Profile.model_validate({
                    "device_type": device_type, "model": OPT_350M.model_dump(), "micro_batch_size": int(mbs),
                    "tensor_parallel": int(tp), "dtype": "fp16", "layers": layer_rows(layers, where)})
                name = f"{sailor_name}-mb{int(mbs)}-tp{int(tp)}.json"
                write_atomic(os.path.join(out_dir, name), profile.model_dump_json(indent=1), "profile", [path])
                written.append(name)
    return written


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkout", help="a checkout of github.com/eth-easl/sailor")
    ap.add_argument("out_dir")
    args = ap.parse_args(argv)
    try:
        written = convert(args.checkout, args.out_dir)
    except (InputError, ValueError) as exc:  # ValueError: a JSON or profile record that does not parse
        print(f"error: {str(exc).splitlines()[0]}", file=sys.stderr)
        sys.exit(2)
    print(f"{len(written)} profiles written to {args.out_dir}")


if __name__ == "__main__":
    main()
