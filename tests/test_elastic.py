"""Tier 2 (multi-process gloo): an elastic start re-plans for the ranks present and resumes from the newest checkpoint.

Two hosts of the plan's cluster, "fast" and "slow", two devices each. The job trains on both and the engine saves
every 2 steps by itself; it stops between two saves (the work since the last save is what a lost host costs). The
ranks of "fast" alone start next: they agree on who is there, rank 0 re-plans for two FAST devices, and the job
resumes from the newest complete checkpoint; then both hosts again, under the plan for both. Every step's loss
equals one process training the same global batches (float64), each plan the job ran under is in
DIR/plans/step-<k>.json, and each start says in one line which hosts are missing.
"""
import json
import os
import subprocess
import sys
import time

import pytest

from conftest import ROOT, SITE
from dist_util import run_python, spawn
from hethub.partitioner import load_plan
from instances import two_host_cluster, write_elastic_plan

pytestmark = pytest.mark.dist

pytest.importorskip("deepspeed")

WORKER = os.path.join("tests", "workers", "elastic.py")
TWO_HOSTS = two_host_cluster("fast", "slow")
BOTH, FAST_ONLY = "fast,fast,slow,slow", "fast,fast"
RESUMED: dict[str, list] = {}  # per phase: rank 0's "resumed from" lines


def _base_plan(tmp_path) -> str:
    return write_elastic_plan(TWO_HOSTS, tmp_path / "plan.json")


def _phase(tmp_path, plan, name, hosts, last, ckpt_name="ckpt", background="1"):
    ckpt = str(tmp_path / ckpt_name)
    out = str(tmp_path / f"{name}-{{rank}}.json")
    results = spawn(len(hosts.split(",")), [WORKER, plan, out, ckpt, "2", str(last), hosts, background], timeout=120)
    for rank, (rc, _o, err) in enumerate(results):
        assert rc == 0, f"{name} rank {rank}:\n{err[-3000:]}"
    said = [line for line in results[0][2].splitlines() if line.startswith("hethub elastic:")]
    RESUMED[name] = [line for line in results[0][2].splitlines() if line.startswith("hethub: resumed from")]
    got = [json.load(open(out.replace("{rank}", str(r)))) for r in range(len(results))]
    return got, said


def test_an_elastic_job_replans_for_the_host_left_and_grows_back_losing_nothing(tmp_path, capsys):
    plan = _base_plan(tmp_path)
    ref = str(tmp_path / "ref.json")
    r = run_python([WORKER, "single", ref, "9"], timeout=60)
    assert r.returncode == 0, r.stderr
    expect = {int(k): v for k, v in json.load(open(ref))["losses"].items()}

    first, said1 = _phase(tmp_path, plan, "both", BOTH, 5)  # saves at 2 and 4; step 5's work is not saved
    alone, said2 = _phase(tmp_path, plan, "alone", FAST_ONLY, 7)  # "slow" is gone: resumes at 4, saves at 6
    again, said3 = _phase(tmp_path, plan, "again", BOTH, 9)  # "slow" is back: resumes at 6
    assert [g["first"] for g in (first[0], alone[0], again[0])] == [0, 4, 6]
    assert [g["plan_world"] for g in (first[0], alone[0], again[0])] == [4, 2, 4]
    assert alone[0]["hosts"] == ["fast"] and again[0]["hosts"] == ["fast", "slow"]
    for got in (first, alone, again):
        for g in got:  # every rank returns every step's global loss: that of one process on the same batches
            for step, loss in g["losses"].items():
                assert loss == pytest.approx(expect[int(step)], rel=1e-10), (step, g)
    assert "every host present" in said1[0] and "hosts missing: slow" in said2[0] and "every host present" in said3[0]
    assert RESUMED["both"] == [] and len(RESUMED["alone"]) == len(RESUMED["again"]) == 1
    assert "global_step4 at step 4 (" in RESUMED["alone"][0] and "global_step6 at step 6 (" in RESUMED["again"][0]
    assert len(said1) == 1 and "first step under this plan (step 5)" in said2[1] and "after the last step before the " \
        "restart (step 5)" in said2[1]  # the job stood still from its step 5 (unsaved) to its step 5 redone
    plans = tmp_path / "ckpt" / "plans"
    assert sorted(os.listdir(plans)) == [".heartbeat", "step-0.json", "step-4.json", "step-6.json"]
    assert {r.host for st in load_plan(str(plans / "step-4.json")).stages for r in st.replicas} == {"fast"}
    assert load_plan(str(plans / "step-6.json")).world_size == 4
    from hethub.cli.main import main
    assert main(["show", str(tmp_path / "ckpt")]) == 0  # the plans the run ran under, one row each
    shown = capsys.readouterr().out
    rows = [line for line in shown.splitlines() if line.strip().startswith(("│ 0 ", "│ 4 ", "│ 6 "))]
    assert len(rows) == 3 and "slow" not in rows[1] and "slow" in rows[2], shown


def test_workers_on_a_host_the_plan_does_not_name_end_with_one_line_before_any_collective(tmp_path):
    plan = _base_plan(tmp_path)
    results = spawn(2, [WORKER, plan, str(tmp_path / "x{rank}.json"), str(tmp_path / "ckpt"), "2", "1",
                        "elsewhere,elsewhere"], timeout=60)
    for rc, _o, err in results:
        assert rc == 2 and "HETHUB_HOST: 'elsewhere' is not a host of the plan's cluster (fast, slow)" in err, err
        assert len([line for line in err.splitlines() if line.startswith("error:")]) == 1


def test_show_on_a_directory_without_plans_is_one_line(tmp_path, capsys):
    from cli_util import cli_error
    assert "is a directory, not a file" in cli_error(capsys, ["show", str(tmp_path)])


def test_checkpoints_written_in_the_background_hold_the_step_they_were_taken_at(tmp_path, monkeypatch):
    """Checkpoints every 2 steps over 5 steps, written by a thread while training goes on, hold exactly what
    checkpoints written at the step hold (the snapshot is the step's, not a later one's), and the last one, still
    in flight when the script ends, is completed at exit."""
    import torch
    from hethub.runtime.checkpoint import complete_checkpoints, read_meta
    plan = _base_plan(tmp_path)
    _phase(tmp_path, plan, "sync", BOTH, 4, ckpt_name="sync", background="0")
    monkeypatch.setenv("HETHUB_TEST_EXEC", "1")  # ranks as interpreters that exit as a script does (exit hooks run)
    _phase(tmp_path, plan, "bg", BOTH, 4, ckpt_name="bg", background="1")
    for d in ("bg", "sync"):
        assert complete_checkpoints(str(tmp_path / d)) == ["global_step2", "global_step4"], d
        assert (tmp_path / d / "latest").read_text() == "global_step4"
        assert not [f for f in os.listdir(tmp_path / d) if f.startswith(".tmp-")]
    for tag in ("global_step2", "global_step4"):
        bg, sync = tmp_path / "bg" / tag, tmp_path / "sync" / tag
        assert sorted(os.listdir(bg)) == sorted(os.listdir(sync))  # no writer's record is left in it
        assert read_meta(str(bg))["global_steps"] == read_meta(str(sync))["global_steps"] == int(tag[11:])
        for f in sorted(os.listdir(bg)):
            if f.endswith(".pt"):
                a, b = (torch.load(str(d / f), weights_only=True) for d in (bg, sync))
                assert a.keys() == b.keys() and (a or "optim" in f), f  # SGD without momentum keeps no state
                for k in a:
                    assert repr(a[k]) == repr(b[k]), (tag, f, k)


def test_a_checkpoint_whose_writers_did_not_all_finish_is_never_complete(tmp_path, capsys):
    """Rank 0 publishes only with every writer's record of its files: at exit it waits a bounded time, then says
    the checkpoint is left incomplete; the previous one stays the newest complete."""
    import torch
    from hethub.runtime import saving
    from hethub.runtime.checkpoint import FORMAT_VERSION, complete_checkpoints
    meta = {"version": FORMAT_VERSION, "global_steps": 6, "global_samples": 48, "model": {}}
    jobs = [saving.Pending(str(tmp_path), "global_step6", (0, 3), rank, wait_s=0.3, meta=meta) for rank in (0, 3)]
    os.makedirs(jobs[0].tmp)
    saving._write(jobs[0], {"layer_00-model_states.pt": {"w": torch.ones(2)}})
    saving._LAST[0] = jobs[0]
    saving._finish_at_exit()  # rank 3 never wrote its part
    assert "checkpoint 'global_step6' was still being written at exit and is left incomplete (checkpoint: ranks 3 " \
           "did not finish writing within 0.3 s)" in capsys.readouterr().err
    assert complete_checkpoints(str(tmp_path)) == [] and not (tmp_path / "latest").exists()
    saving._write(jobs[1], {"layer_01-model_states.pt": {"w": torch.zeros(2)}})
    saving._finish_at_exit()  # now both have: rank 0 publishes
    saving._LAST[0] = None
    assert complete_checkpoints(str(tmp_path)) == ["global_step6"] and (tmp_path / "latest").read_text() == "global_step6"
    assert sorted(os.listdir(tmp_path / "global_step6")) == ["layer_00-model_states.pt", "layer_01-model_states.pt",
                                                             "meta.json"]
    full = json.load(open(tmp_path / "global_step6" / "meta.json"))
    assert sorted(full["digests"]) == ["layer_00-model_states.pt", "layer_01-model_states.pt"]


def _plan_needing_both_hosts(tmp_path) -> str:
    """The two-host plan where a device holds 4 GiB: the model needs all four devices."""
    return write_elastic_plan(two_host_cluster("fast", "slow", memory_gib=4), tmp_path / "plan.json")


def test_hosts_left_that_cannot_hold_the_model_end_the_job_with_one_line(tmp_path):
    """With 4 GiB a device, the model needs all four: the FAST host alone cannot hold it. Every worker ends with
    the planner's line (exit 2) and leaves it in DIR/plans/.stop, where every host's launcher reads it and ends the
    job instead of restarting it (no restart brings the memory back)."""
    path, ckpt = _plan_needing_both_hosts(tmp_path), tmp_path / "ckpt"
    results = spawn(2, [WORKER, str(path), str(tmp_path / "x{rank}.json"), str(ckpt), "2", "3", FAST_ONLY],
                    timeout=60)
    for rc, _o, err in results:
        errs = [line for line in err.splitlines() if line.startswith("error:")]
        assert rc == 2 and len(errs) == 1 and errs[0].startswith("error: elastic: memory:"), err[-2000:]
    assert (ckpt / "plans" / ".stop").read_text().strip() == errs[0][len("error: "):]


def _launch_for(tmp_path, *flags):
    from hethub.cli import elastic_launch
    plan = tmp_path / "plan.json"
    if not plan.exists():
        plan.write_text(load_plan(_base_plan(tmp_path)).to_json())
    return elastic_launch.parse(str(plan), ["--master_addr", "fast", "--master_port", "29999", "--checkpoint-dir",
                                            str(tmp_path / "ckpt"), "--checkpoint-every", "2", *flags, "train.py"],
                                lambda host: host == "fast")


@pytest.mark.parametrize("case", ["stop", "rendezvous", "restarts"])
def test_the_launcher_ends_the_job_with_one_line_naming_why(tmp_path, monkeypatch, capfd, case):
    """The agent is stood in for by a script: a worker's request to end the job (the agent and its session are
    ended at once), the rendezvous giving up, the restart budget spent. One line each; --log-json gets the event."""
    from hethub.cli import elastic_launch
    el = _launch_for(tmp_path, "--min-nodes", "2", "--max-restarts", "1", "--join-timeout", "7", "--log-json",
                     str(tmp_path / "events.jsonl"))
    stop = tmp_path / "ckpt" / "plans" / ".stop"
    agent = {"stop": "import os, time; os.makedirs(os.path.dirname(P), exist_ok=True); open(P, 'w').write("
                     "'elastic: memory: too small\\n'); time.sleep(60)",
             "rendezvous": "import sys; sys.stderr.write('RendezvousTimeoutError: timed out\\n'); sys.exit(1)",
             "restarts": "import sys; sys.exit(1)"}[case]
    monkeypatch.setattr(elastic_launch, "command", lambda _el: ([sys.executable, "-c", agent.replace("P", repr(
        str(stop)))], dict(os.environ)))
    t0 = time.monotonic()
    rc = elastic_launch.run(el)
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and lines[0].startswith("error: launch --elastic: the job ended on fast: "), err
    assert lines[0].endswith(f"the newest complete checkpoint in {tmp_path / 'ckpt'} is kept")
    why = {"stop": "a worker ended on input no restart can fix: elastic: memory: too small",
           "rendezvous": "fewer than --min-nodes 2 of the plan's 2 hosts were in the rendezvous for --join-timeout 7 s",
           "restarts": "its workers failed after --max-restarts 1 restarts (exit 1; see above)"}[case]
    assert why in lines[0] and rc == (1 if case == "restarts" else 2)
    assert time.monotonic() - t0 < 20  # the stood-in agent's 60 s sleep was ended
    event = json.loads((tmp_path / "events.jsonl").read_text().splitlines()[-1])
    assert event["event"] == "ended" and event["reason"] == why and event["exit"] == rc


def test_launch_elastic_flags_are_checked_one_line_each(tmp_path):
    from hethub.partitioner.errors import InputError
    for flags, message in ((["--join-timeout", "0"], "--join-timeout: must be in 1..604800 (seconds), got 0"),
                           (["--min-nodes", "3"], "--min-nodes: must be in 1..2 (the plan's cluster has 2 hosts), got 3"),
                           (["--max-restarts", "-1"], "--max-restarts: must be in 0..1000, got -1"),
                           (["--checkpoint-every", "0"], "--checkpoint-every: must be at least 1 (steps), got 0")):
        with pytest.raises(InputError) as info:
            _launch_for(tmp_path, *flags)
        assert str(info.value) == message
    el = _launch_for(tmp_path, "--log-json", "ev.jsonl")
    cmd, env = __import__("hethub.cli.elastic_launch", fromlist=["command"]).command(el)
    assert "join_timeout=120" in " ".join(cmd) and env["HETHUB_EVENTS"] == os.path.abspath("ev.jsonl")


@pytest.mark.slow
def test_under_torch_elastic_a_job_the_hosts_present_cannot_hold_ends_at_once(tmp_path):
    """`hethub launch --elastic` on the FAST host alone (torch's agent, c10d rendezvous, 3 restarts allowed): its
    workers cannot hold the model, end with the planner's line, and the launcher ends the job at once with one line
    (exit 2) instead of letting the agent restart it three times."""
    from dist_util import free_port
    ckpt = tmp_path / "ckpt"
    cmd = [sys.executable, "-m", "hethub.cli", "launch", "--hetero-plan", _plan_needing_both_hosts(tmp_path),
           "--elastic", "--master_addr", "127.0.0.1", "--master_port", str(free_port()), "--checkpoint-dir",
           str(ckpt), "--checkpoint-every", "2", "--max-restarts", "3", "--host", "fast",
           os.path.join(ROOT, WORKER), str(tmp_path / "log.jsonl"), "3", "0"]
    r = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", PYTHONPATH=ROOT + os.pathsep + SITE),
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    ended = [line for line in r.stderr.splitlines() if line.startswith("error: launch --elastic")]
    assert r.returncode == 2 and len(ended) == 1, r.stderr[-3000:]
    assert "a worker ended on input no restart can fix: elastic: memory:" in ended[0], ended[0]
    assert (ckpt / "plans" / ".stop").exists() and not os.path.exists(tmp_path / "log.jsonl")  # no step ran


def test_the_re_plan_keeps_the_plans_network_model_and_refuses_an_unknown_one(tmp_path):
    """A plan planned with ``--network no-overlap`` is re-planned so too; a plan file naming a model hethub does
    not have is one line naming the field (before any planning)."""
    from hethub.partitioner import InputError
    from hethub.runtime.elastic import replan
    from hethub.partitioner.records import Plan
    base = load_plan(_base_plan(tmp_path))
    assert base.solver.network == "overlap"
    robust = base.model_copy(update={"solver": base.solver.model_copy(update={"network": "no-overlap"})})
    assert replan(robust, base.cluster).solver.network == "no-overlap"
    odd = Plan.model_validate_json(base.model_copy(update={"solver": base.solver.model_copy(
        update={"network": "sailor"})}).to_json())
    with pytest.raises(InputError, match=r"^plan.solver.network: expected one of overlap, no-overlap, got 'sailor'"):
        replan(odd, base.cluster)
