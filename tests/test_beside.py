"""Work beside the main search (``partitioner.beside``): `plan`'s comparisons run in a forked process during the
search. The answer is the one the same work gives in this process; a failure there is one error here, a child
that never answers is ended (never a frozen command), and an interrupted parent leaves no child behind."""
import os
import time

import pytest

from hethub.partitioner import beside
from hethub.partitioner.api import _comparisons, _decoded, make_plan
from hethub.partitioner.costmodel import CostModel
from hethub.partitioner.errors import InfeasibleError, InputError
from hethub.partitioner.planner import PlannerOptions
from hethub.partitioner.records import builtin_model, load_cluster

CLUSTER = os.path.join(os.path.dirname(__file__), "..", "examples", "cluster-2type.yaml")
needs_fork = pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this OS: the work runs in-process")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is gone but for its exit code
        return f.read().split(")")[-1].split()[0] != "Z"


@needs_fork
def test_the_comparisons_made_beside_are_those_made_here():
    cm = CostModel(load_cluster(CLUSTER), builtin_model("gpt-1.3b"))
    # proven well within it; the replays that choose among the searches' plans end by a deadline set from the
    # limit, so it leaves them room when a loaded suite slows the forked child (at 20 s under 4 workers, the
    # V100 comparison replayed fewer plans there and chose another)
    opts = PlannerOptions(time_limit_s=60, schedule="1f1b")
    work = lambda: _comparisons(cm, 32, opts, ("uniform", "parameters"))  # noqa: E731
    with beside.Beside(work, 10, concurrent=True) as there:
        assert there.concurrent
        far = _decoded(there.result())
    near = _decoded(beside.Beside(work, 10, concurrent=False).result())
    for got, want in zip(far, near):
        assert set(got) == set(want)
        for k in want:
            if isinstance(want[k], InfeasibleError):
                assert isinstance(got[k], InfeasibleError) and str(got[k]) == str(want[k])
            elif want[k] is None:
                assert got[k] is None
            else:  # the same plan, priced alike (the searches prove their plans optimal here)
                assert got[k].stages == want[k].stages and got[k].predicted.iteration_s == pytest.approx(
                    want[k].predicted.iteration_s, rel=1e-12), k


@needs_fork
def test_make_plan_fills_the_comparisons_from_beside_as_from_here(monkeypatch):
    cm = CostModel(load_cluster(CLUSTER), builtin_model("gpt-1.3b"))
    # proven well within it; the replays that choose among the searches' plans end by a deadline set from the
    # limit, so it leaves them room when a loaded suite slows the forked child (at 20 s under 4 workers, the
    # V100 comparison replayed fewer plans there and chose another)
    opts = PlannerOptions(time_limit_s=60, schedule="1f1b")
    got = {}
    for concurrent in (True, False):
        monkeypatch.setattr(beside, "can_run_beside", lambda: concurrent)
        homog, bases = {}, {}
        plan = make_plan(cm.cluster, cm.model, 32, opts=opts, cost_model=cm, homogeneous=homog, baselines=bases)
        got[concurrent] = (plan.predicted.homogeneous_sum_samples_per_s, sorted(homog), sorted(bases))
    assert got[True][1:] == got[False][1:] and got[True][0] == pytest.approx(got[False][0], rel=1e-12)


@needs_fork
@pytest.mark.parametrize("concurrent", [True, False])
def test_a_failure_beside_is_one_error_here(concurrent):
    def bad_input():
        raise InputError("--cluster", "no such thing")

    def broken():
        raise ZeroDivisionError("1/0")
    with pytest.raises(InputError, match="^--cluster: no such thing$"):
        beside.Beside(bad_input, 10, concurrent=concurrent).result()
    with pytest.raises(RuntimeError if concurrent else ZeroDivisionError, match="ZeroDivisionError: 1/0"
                       if concurrent else "1/0"):
        beside.Beside(broken, 10, concurrent=concurrent).result()


@needs_fork
def test_a_child_that_never_answers_is_ended_and_named(monkeypatch):
    monkeypatch.setattr(beside, "GRACE_S", 0.5)
    there = beside.Beside(lambda: time.sleep(60), 0.5, concurrent=True)
    pid = there._pid
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"the comparisons' process gave no answer within 1 s \(`plan --no-compare`"):
        there.result()
    assert time.monotonic() - started < 10 and not _alive(pid)


@needs_fork
def test_leaving_early_ends_the_child():
    """What the parent does when Ctrl-C (or an error) ends the main search: the child goes with it."""
    with beside.Beside(lambda: time.sleep(60), 60, concurrent=True) as there:
        pid = there._pid
        assert _alive(pid)
    assert not _alive(pid)
