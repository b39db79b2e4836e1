"""Which measured profiles a plan was priced with, and finding them again.

Why: a plan made with ``--profiles`` and simulated without them was replayed on the analytic model and
reported +5525% against its own prediction, silently. The plan now records each profile file (its path
relative to the plan's folder, so that the two can move together, and its sha256); ``hethub simulate``
uses the recorded files when their bytes still match, and otherwise says which file and why.

A plan is untrusted data: a recorded path is read only up to MAX_FILE_BYTES and hashed, and parsed only
when its digest is the recorded one, i.e. only a file whose bytes were a profile when the plan was made.
"""
from __future__ import annotations

import hashlib
import os
from typing import Optional, Sequence

from .records import MAX_FILE_BYTES, Plan, Profile, ProfileRef, load_profile


def sha256_file(path: str) -> str:
    """Hex sha256 of a file's bytes, read in 1 MiB blocks (a plan's profiles, a checkpoint's layer files)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def file_sha256(path: str) -> Optional[str]:
    """Hex sha256 of a regular file of at most MAX_FILE_BYTES; None if it is missing, not a file or larger."""
    if not os.path.isfile(path) or os.path.getsize(path) > MAX_FILE_BYTES:
        return None
    return sha256_file(path)


def profile_refs(directory: str, plan_path: str, profiles: Sequence[Profile]) -> list[ProfileRef]:
    """What a plan written at ``plan_path`` records of the profiles in ``directory``; ``profiles`` are those
    files as ``load_profiles`` read them (sorted by name, so in this order), not read again here."""
    base = os.path.dirname(os.path.abspath(plan_path))
    names = sorted(f for f in os.listdir(directory) if f.endswith(".json"))
    return [ProfileRef(path=os.path.relpath(os.path.abspath(os.path.join(directory, name)), base),
                       sha256=file_sha256(os.path.join(directory, name)) or "", device_type=prof.device_type)
            for name, prof in zip(names, profiles)]


def recorded_profiles(plan: Plan, plan_path: str) -> tuple[list[Profile], list[str]]:
    """(the plan's recorded profiles that are still there, byte for byte; a note for each that is not)."""
    base = os.path.dirname(os.path.abspath(plan_path))
    found, notes = [], []
    for i, ref in enumerate(plan.profiles):
        path = os.path.normpath(os.path.join(base, ref.path))
        digest = file_sha256(path)
        if digest is None:
            notes.append(f"profiles[{i}]: {ref.path} ({ref.device_type}) is not at {path}")
        elif digest != ref.sha256:
            notes.append(f"profiles[{i}]: {path} changed since the plan was made (sha256 {digest[:12]}, "
                         f"recorded {ref.sha256[:12]})")
        else:
            found.append(load_profile(path))
    return found, notes


def unrecorded(plan: Plan, directory: str) -> list[str]:
    """Notes on how ``--profiles DIR`` differs from what the plan recorded (empty: the same bytes)."""
    given = {file_sha256(os.path.join(directory, f)) for f in os.listdir(directory) if f.endswith(".json")}
    recorded = {ref.sha256 for ref in plan.profiles}
    if not recorded:
        return ["the plan was made with the analytic cost model; its prediction does not use these profiles"]
    if given != recorded:
        return [f"{directory}: {len(given - recorded)} of its profiles are not the ones the plan was made with "
                f"({len(recorded - given)} recorded ones are missing there)"]
    return []


def as_notes(refs: Sequence[ProfileRef]) -> str:
    return ", ".join(f"{r.path} ({r.device_type}, sha256 {r.sha256[:12]})" for r in refs)
