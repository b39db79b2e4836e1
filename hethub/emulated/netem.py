"""Emulated hosts on one machine: network namespaces joined by a veth pair, the link optionally rate-limited.

Why: a heterogeneous plan prices every stage boundary that crosses hosts at the cluster's inter-node
link. On one machine every rank talks over loopback, so neither the multi-host launch nor that price
is ever exercised. Two namespaces, each with its own address, are two hosts that reach each other
over one link only; a token bucket (``tc`` tbf) on both ends gives that link a known rate. Used by
``tests/test_multihost.py`` and ``benchmarks/multihost.py``. Needs root and iproute2 (``ip``, ``tc``).
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
from typing import Iterator, NamedTuple, Optional

ADDRS = ("10.213.0.1", "10.213.0.2")  # private, inside namespaces of their own: nothing else sees them


class Host(NamedTuple):
    namespace: str
    interface: str
    address: str


def ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


def _must(cmd: list[str]) -> None:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if r.returncode:
        raise OSError(f"{' '.join(cmd)}: {r.stderr.strip()[:200]}")


@contextlib.contextmanager
def two_hosts(rate_mbit: Optional[float] = None, tag: str = "") -> Iterator[list[Host]]:
    """Two hosts joined by a veth pair (each direction shaped to ``rate_mbit`` when given); removed on exit.
    Raises OSError when this machine cannot make them."""
    tag = tag or str(os.getpid())[-6:]
    names, links = [f"hh{tag}a", f"hh{tag}b"], [f"hv{tag}a", f"hv{tag}b"]  # interface names: 15 chars at most
    made = []
    try:
        for ns in names:
            _must(["ip", "netns", "add", ns])
            made.append(ns)
        _must(["ip", "link", "add", links[0], "type", "veth", "peer", "name", links[1]])
        for ns, link, addr in zip(names, links, ADDRS):
            for step in (("link", "set", link, "netns", ns), ("-n", ns, "addr", "add", f"{addr}/24", "dev", link),
                         ("-n", ns, "link", "set", link, "up"), ("-n", ns, "link", "set", "lo", "up")):
                _must(["ip", *step])
            if rate_mbit:
                # Token bucket (tbf) with a small bucket: 1 ms at the rate, at least four full-size packets. The
                # link's offload packets are capped at one MTU (gso_max_size) to fit it; a 64 KiB bucket refilled
                # during compute and let each next message out faster than the rate.
                burst = max(4 * 1514, int(rate_mbit * 1e6 / 8 * 0.001))
                _must(["ip", "-n", ns, "link", "set", "dev", link, "gso_max_size", "1500"])
                _must(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", link, "root", "tbf", "rate",
                       f"{rate_mbit}mbit", "burst", str(burst), "latency", "100ms"])
        yield [Host(ns, link, addr) for ns, link, addr in zip(names, links, ADDRS)]
    finally:
        for ns in made:  # deleting a namespace deletes its end of the veth pair, and so the pair
            ip("netns", "del", ns)


def tx_bytes(host: Host) -> int:
    """Bytes the host has sent over its link."""
    r = ip("-j", "-s", "-n", host.namespace, "link", "show", "dev", host.interface)
    return int(json.loads(r.stdout)[0]["stats64"]["tx"]["bytes"])


def probe() -> tuple[bool, bool]:
    """(two hosts can be made here, and a process in one can get UTS and mount namespaces of its own)."""
    if shutil.which("ip") is None or os.geteuid() != 0:
        return False, False
    try:
        with two_hosts(tag=f"p{os.getpid() % 100000}") as hosts:
            ns = hosts[1].namespace
            _must(["ip", "netns", "exec", ns, "true"])
            own = shutil.which("unshare") is not None and subprocess.run(
                ["ip", "netns", "exec", ns, "unshare", "--uts", "--mount", "sh", "-c", "hostname probe"],
                capture_output=True, timeout=30).returncode == 0
            return True, own
    except (OSError, subprocess.SubprocessError):
        return False, False
