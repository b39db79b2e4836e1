"""``hethub plan --what-if``: the cluster changed by a sentence, planned again, and the difference.

Sentences (several joined with ";"):

- ``add N TYPE`` — N devices of TYPE (built-in or defined in the cluster), on new hosts ``whatif-TYPE-k``
  of the type's largest node size (8 for a type the cluster does not have yet);
- ``remove N TYPE`` — N devices of TYPE, from its last nodes first;
- ``remove host HOST`` — the whole node.

Why a sentence and not an edited cluster file: the question asked at a procurement meeting is "what do 16
more V100s buy us", and the answer must come from the same planner, cost model and time limit as the plan
it is compared with.
"""
from __future__ import annotations

import re

from .errors import InputError
from .records import MAX_DEVICES, Cluster, builtin_device_type

_ADD = re.compile(r"^add\s+(\d+)\s+(\S+)$", re.I)
_REMOVE = re.compile(r"^remove\s+(\d+)\s+(\S+)$", re.I)
_HOST = re.compile(r"^remove\s+host\s+(\S+)$", re.I)


def apply_what_if(cluster: Cluster, text: str) -> Cluster:
    """The cluster after every sentence of ``text``; one InputError naming ``--what-if`` otherwise."""
    nodes = [n.model_dump() for n in cluster.nodes]
    sentences = [s.strip() for s in text.split(";") if s.strip()]
    if not sentences:
        raise InputError("--what-if", "expected 'add N TYPE', 'remove N TYPE' or 'remove host HOST'")
    for sentence in sentences:
        short = sentence[:80]
        if m := _HOST.match(sentence):
            host = m.group(1)
            if not any(n["host"] == host for n in nodes):
                raise InputError("--what-if", f"{short!r}: no host {host!r} in cluster {cluster.name!r}")
            nodes = [n for n in nodes if n["host"] != host]
        elif m := _ADD.match(sentence):
            count, t = _count(m.group(1), short), m.group(2)
            _known_type(cluster, t, short)
            have = sum(n["count"] for n in nodes)
            if count < 1 or have + count > MAX_DEVICES:
                raise InputError("--what-if", f"{short!r}: add 1 to {MAX_DEVICES - have} devices (a cluster holds at "
                                              f"most {MAX_DEVICES}, this one {have})")
            size = max((n["count"] for n in nodes if n["device_type"] == t), default=8)
            k = 0
            while count > 0:
                host = f"whatif-{t}-{k}"
                k += 1
                if any(n["host"] == host for n in nodes):
                    continue
                nodes.append({"host": host, "device_type": t, "count": min(size, count)})
                count -= min(size, count)
        elif m := _REMOVE.match(sentence):
            count, t = _count(m.group(1), short), m.group(2)
            have = sum(n["count"] for n in nodes if n["device_type"] == t)
            if count < 1 or count > have:
                raise InputError("--what-if", f"{short!r}: the cluster has {have} {t} devices")
            for n in reversed(nodes):
                if n["device_type"] == t and count:
                    take = min(n["count"], count)
                    n["count"] -= take
                    count -= take
            nodes = [n for n in nodes if n["count"] > 0]
        else:
            raise InputError("--what-if", f"{short!r}: expected 'add N TYPE', 'remove N TYPE' or 'remove host HOST'")
    if not nodes:
        raise InputError("--what-if", f"{text[:80]!r} leaves no devices")
    data = cluster.model_dump()
    intra = data["network"]["intra_node_gbps"]
    if isinstance(intra, dict):  # a new type gets the slowest listed link, as the cost model does for gaps
        for n in nodes:
            intra.setdefault(n["device_type"], min(intra.values()))
    try:
        return Cluster.model_validate({**data, "nodes": nodes})
    except ValueError as exc:
        raise InputError("--what-if", f"{text[:80]!r} gives an invalid cluster: {str(exc).splitlines()[-1][:120]}") \
            from None


def _count(digits: str, sentence: str) -> int:
    """A device count, read only when it can be one: int() of thousands of digits is slow, then refused."""
    if len(digits) > len(str(MAX_DEVICES)):
        raise InputError("--what-if", f"{sentence!r}: a count is at most {MAX_DEVICES}")
    return int(digits)


def _known_type(cluster: Cluster, t: str, sentence: str) -> None:
    if t in cluster.device_types:
        return
    try:
        builtin_device_type(t)
    except InputError:
        raise InputError("--what-if", f"{sentence!r}: unknown device type {t!r}; define it under the cluster's "
                                      f"device_types or use a built-in") from None
