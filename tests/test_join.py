"""The join (hethub.runtime.join): ranks that start at different times wait for each other up to their own
timeout, rank 0 says whom it waits for, and a rank that never comes ends the others with one line naming it."""
import subprocess
import sys
import threading
import time

import pytest

from conftest import ROOT
from dist_util import free_port
from hethub.runtime import join


def test_ranges_say_the_ranks_in_short():
    assert join._ranges([0, 2, 3, 4, 7]) == "0, 2-4, 7"
    assert join._ranges([5]) == "5"


@pytest.mark.parametrize("hosts", [["a", "b"], ["a", "a"]])
def test_a_rank_that_starts_late_is_waited_for_and_named_if_on_another_host(monkeypatch, capsys, hosts):
    """Rank 1 starts a second late. On another host rank 0 names it while waiting; on rank 0's own host (its
    launcher started it: it is importing) rank 0 says nothing."""
    monkeypatch.setattr(join, "WAIT_NOTE_S", 0.2)
    port = free_port()
    joined = []
    asked = threading.Event()  # rank 0 has waited past WAIT_NOTE_S with rank 1 missing (a loaded machine may
    note = join._note          # take longer than any fixed delay to get rank 0 there)

    def noting(*args, **kwargs):
        asked.set()
        return note(*args, **kwargs)
    monkeypatch.setattr(join, "_note", noting)

    def rank(r: int, delay_s: float):
        time.sleep(delay_s)
        if r == 1:
            assert asked.wait(20)
        store = join.open_store(r, 2, "127.0.0.1", port, 20)
        join.join(store, r, 2, 20, hosts=hosts)
        joined.append((r, time.monotonic()))
        if r == 0:
            while len(joined) < 2:  # rank 0 serves the store: it stays until the other has joined
                time.sleep(0.05)
    threads = [threading.Thread(target=rank, args=(0, 0.0)), threading.Thread(target=rank, args=(1, 1.0))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(r for r, _ in joined) == [0, 1]
    assert abs(joined[0][1] - joined[1][1]) < 2.0  # both left the join together, after the late one came
    err = capsys.readouterr().err
    said = "hethub: 1 rank of 2 joined; waiting up to 20 s (hetero.join_timeout_s) for rank(s) 1 (host b)"
    assert (said in err) == (hosts[1] == "b") and (err.strip() == "" or hosts[1] == "b"), err


def test_a_rank_that_never_comes_ends_rank_0_with_one_line_naming_it():
    code = ("from hethub.runtime import join; s = join.open_store(0, 3, '127.0.0.1', %d, 1); "
            "join.join(s, 0, 3, 1, hosts=['a', 'b', 'b'])" % free_port())
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 3, out.stderr[-2000:]
    assert out.stderr.strip().splitlines() == [
        "error: rank 0: rank(s) 1-2 (host b) did not join within hetero.join_timeout_s = 1 s: start `hethub launch` "
        "on every host of the plan, with the same --master_addr and --master_port"], out.stderr[-2000:]


def test_rank_0s_store_never_coming_up_ends_a_rank_with_one_line():
    code = ("from hethub.runtime import join; join.open_store(1, 2, '127.0.0.1', %d, 1)" % free_port())
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 3, out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: rank 1: rank 0's store at 127.0.0.1:"), lines
    assert "did not answer within hetero.join_timeout_s = 1 s" in lines[0], lines
