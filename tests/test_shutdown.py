"""Tier 2: how a run ends. A finished script exits 0 on every rank; a user's bug shows its traceback on its
rank, and the other ranks end within seconds naming it (never mistaken for a lost peer on the failing rank)."""
import os
import re
import time

import pytest

from dist_util import spawn
from plans import CASES, stack_plan, write_plan

pytestmark = pytest.mark.dist
WORKER = os.path.join("tests", "workers", "train_stack.py")


@pytest.mark.slow
def test_finished_runs_exit_0_on_every_rank_six_times(tmp_path):
    """Rank 0 works on after training while the others are done: without hethub's exit barrier and
    destroy_process_group, a rank aborted at exit in about 1 of 3 such runs (six runs catch that 91% of
    the time)."""
    from concurrent.futures import ThreadPoolExecutor
    path = write_plan(tmp_path, stack_plan(*CASES["1to1"]))

    def one(run):
        return spawn(2, [WORKER, path, str(tmp_path / f"r{run}-{{rank}}.pt"), "1", "0"], timeout=120,
                     extra_env={"END_SLEEP_RANK0": "0.5"})
    with ThreadPoolExecutor(max_workers=2) as pool:  # two jobs at a time: each mostly starts up and sleeps
        for run, results in enumerate(pool.map(one, range(6))):
            assert [rc for rc, _, _ in results] == [0, 0], (run, [e[-1500:] for _, _, e in results])


def test_forked_ranks_end_as_interpreters_do(tmp_path):
    """The ranks these tests fork run the script's atexit hooks, after its end or its uncaught exception, as
    ``python script.py`` does: hethub's exit barrier and a checkpoint's last write live there, and a forked
    multiprocessing child skips them unless told (then every test above passed without ever running them)."""
    script = ("import atexit, os, sys\n"
              "atexit.register(lambda: open(os.environ['MARK'] + os.environ['RANK'], 'w').write('ran'))\n"
              "if os.environ['RANK'] == '1':\n"
              "    raise RuntimeError('a user bug')\n")
    results = spawn(2, ["-c", script], timeout=60, extra_env={"MARK": str(tmp_path / "hook")})
    assert [rc for rc, _, _ in results] == [0, 1], results
    assert "RuntimeError: a user bug" in results[1][2]
    assert all((tmp_path / f"hook{r}").read_text() == "ran" for r in range(2))


def test_a_users_error_shows_its_traceback_and_peers_name_its_rank(tmp_path):
    path = write_plan(tmp_path, stack_plan(*CASES["1to2"]))
    t0 = time.monotonic()
    results = spawn(3, [WORKER, path, str(tmp_path / "r{rank}.pt"), "5", "0"], timeout=90,
                    extra_env={"FAIL_AT": "1:2"})
    assert time.monotonic() - t0 < 60
    rc, _, err = results[1]
    assert rc != 0 and "Traceback" in err and "RuntimeError: user bug in a layer" in err
    assert "lost rank" not in err
    for r in (0, 2):
        rc, _, err = results[r]
        last = err.strip().splitlines()[-1]
        named = re.search(r"lost rank\(s\) ([\d, ]+) during", last)
        assert rc == 3 and last.startswith(f"error: rank {r} (stage ") and named, err[-1500:]
        assert "1" in named.group(1).split(", "), last
