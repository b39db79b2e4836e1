"""Emulated heterogeneity on one machine: ranks slowed to a device type's speed (``slowdown``), optionally pinned to
the times of its profiles (``pinned``), and hosts in network namespaces on a rate-limited link (``netem``). Test and
benchmark helpers; training never needs them."""
