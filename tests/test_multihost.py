"""Two hosts for real: two network namespaces, each with its own address on a veth pair, and one
``hethub launch --no_ssh`` in each, which finds its node rank by address or host name. The ranks
reach each other over that link only (GLOO_SOCKET_IFNAME), and the run must train exactly like the
same plan launched on one host.

Skipped where the machine cannot make network namespaces (not root, no iproute2)."""
import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest

from conftest import EXAMPLES, ROOT, SITE
from dist_util import run_python, wait_for_line
from hethub.emulated.netem import ADDRS, ip, probe, tx_bytes, two_hosts
from hethub.partitioner import Cluster, Plan
from hethub.partitioner.placement import StageLayout, build_plan
from plans import MODEL, UNEQUAL, unequal_plan

pytest.importorskip("deepspeed")

HOSTS_WORK, UNSHARE_WORKS = probe()
# one xdist worker runs them all, one after another: they make the same two network namespaces
pytestmark = [pytest.mark.dist, pytest.mark.xdist_group("two-hosts"),
              pytest.mark.skipif(not HOSTS_WORK, reason="needs root and iproute2 to make two hosts in network "
                                                        "namespaces")]
TRAIN = [os.path.join(EXAMPLES, "train_gpt.py")]


def _losses(path) -> list[float]:
    with open(path) as f:
        return [step["loss"] for step in json.load(f)]


def _two_host_plan(tmp_path) -> tuple[Plan, str]:
    """Stage 0: 2 ranks on the host at ADDRS[0] (node 0); stage 1: 3 ranks on host 'big' (node 1)."""
    data = unequal_plan().model_dump()
    for rec in data["cluster"]["nodes"] + [r for st in data["stages"] for r in st["replicas"]]:
        rec["host"] = ADDRS[0] if rec["host"] == "small" else rec["host"]
    plan = Plan.model_validate(data)
    path = tmp_path / "plan.json"
    path.write_text(plan.to_json())
    return plan, str(path)


def _pair_plan(tmp_path) -> tuple[Plan, str]:
    """One rank a host: stage 0 on the host at ADDRS[0] (node 0), stage 1 on host 'big' (node 1). For the
    scenarios that end the run (a cut link, checkpoints the hosts do not share): what they check holds for any
    width, and each rank started through the launcher costs seconds of CPU."""
    cluster = Cluster.model_validate({**UNEQUAL.model_dump(), "nodes": [
        {"host": ADDRS[0], "device_type": "X", "count": 1}, {"host": "big", "device_type": "X", "count": 1}]})
    plan = build_plan(MODEL, cluster, [StageLayout((0, 2), "X", (4,)), StageLayout((2, 4), "X", (4,))], 4, 2)
    path = tmp_path / "plan.json"
    path.write_text(plan.to_json())
    return plan, str(path)


def _env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", PYTHONPATH=ROOT + os.pathsep + SITE)


def _launch_cmd(plan_path: str) -> list[str]:
    return [sys.executable, "-m", "hethub.cli", "launch", "--hetero-plan", plan_path]


def _start_on_hosts(hosts, plan_path: str, script_args: list[str], own_flags: tuple = (), private_dir: str = "",
                    private_source: str = "", nodes: tuple = (0, 1)) -> list[subprocess.Popen]:
    """One `hethub launch --no_ssh` per host. No --node_rank: node 0 holds the plan's address ADDRS[0],
    node 1 is named 'big' in a UTS namespace of its own (given --node_rank 1 where unshare is missing).
    ``private_dir``: node 1 sees there, in a mount namespace of its own, ``private_source`` (or an empty tmpfs):
    a directory the hosts do not share. ``nodes``: the hosts to start it on."""
    procs = []
    for node, (ns, link, _) in enumerate(hosts):
        if node not in nodes:
            continue
        cmd = ["ip", "netns", "exec", ns, *_launch_cmd(plan_path), *own_flags, "--no_ssh", "--master_addr", ADDRS[0]]
        if node == 1 and private_dir:
            mount = f"mount --bind {private_source}" if private_source else "mount -t tmpfs hethub-test"
            cmd = ["ip", "netns", "exec", ns, "unshare", "--uts", "--mount", "sh", "-c",
                   f'hostname big && {mount} {private_dir} && exec "$@"', "sh", *cmd[4:]]
        elif node == 1 and UNSHARE_WORKS:
            cmd = ["ip", "netns", "exec", ns, "unshare", "--uts", "sh", "-c", 'hostname big && exec "$@"', "sh",
                   *cmd[4:]]
        elif node == 1:
            cmd += ["--node_rank", "1"]
        procs.append(subprocess.Popen([*cmd, *script_args], env=dict(_env(), GLOO_SOCKET_IFNAME=link), cwd=ROOT,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      start_new_session=True))
    return procs


def _finish(procs: list[subprocess.Popen], timeout_s: float) -> list[str]:
    """Every launch's output; any launch still running after ``timeout_s`` is killed (and the test fails)."""
    try:
        return [p.communicate(timeout=timeout_s)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()


def _train_here(d, plan_path: str, world_size: int) -> list[float]:
    """The plan trained 3 steps with every rank on this host (--local), saved after step 3 under ``d/ckpt``."""
    from dist_util import spawn  # ranks from the test's fork server: the launcher's start-up is tested elsewhere
    results = spawn(world_size, [*TRAIN, "--hetero-plan", plan_path, "--steps", "3", "--log-json", str(d / "log.json"),
                                 "--save-dir", str(d / "ckpt"), "--save-every", "3"], timeout=180,
                    extra_env={"HETHUB_LOCAL": "1"})
    assert all(rc == 0 for rc, _o, _e in results), [e[-2000:] for _rc, _o, e in results]
    return _losses(d / "log.json")


@pytest.fixture(scope="module")
def one_host(tmp_path_factory):
    """The two-host plan trained on this host: (plan, plan path, losses, the checkpoint saved after step 3)."""
    d = tmp_path_factory.mktemp("one-host")
    plan, path = _two_host_plan(d)
    return plan, path, _train_here(d, path, plan.world_size), d / "ckpt"


@pytest.mark.slow
def test_a_cut_link_ends_every_rank_on_both_hosts_with_one_line(tmp_path):
    """The link between the hosts goes down mid-run (no process dies, no connection is reset): every rank on
    both hosts ends within hetero.timeout_s (plus start-up), each with one line naming the ranks it lost."""
    plan, path = _pair_plan(tmp_path)
    config = tmp_path / "ds.json"
    # 10 s: under the suite's load a rank can wait seconds for a starved peer; the cut must be what ends the run
    config.write_text(json.dumps({"hetero": {"timeout_s": 10}}))
    train = [*TRAIN, "--steps", "1000000", "--deepspeed_config", str(config)]
    with two_hosts() as hosts:
        procs = _start_on_hosts(hosts, path, train)
        try:
            wait_for_line(procs[0].stdout, r"^step +2 ", timeout=120)  # training under way across the link
        except AssertionError as exc:  # say what the ranks printed instead
            for proc in procs:
                if proc.poll() is None:
                    os.killpg(proc.pid, 9)
            outs = [proc.communicate()[0] for proc in procs]
            raise AssertionError(f"{exc}:\n" + "\n".join(o[-3000:] for o in outs)) from None
        assert ip("-n", hosts[0].namespace, "link", "set", hosts[0].interface, "down").returncode == 0
        t_cut = time.monotonic()
        outs = _finish(procs, 60)
        took_s = time.monotonic() - t_cut
    assert [p.returncode for p in procs] == [3, 3], "\n".join(o[-2000:] for o in outs)
    errors = [l for o in outs for l in o.splitlines() if l.startswith("error:")]
    ranks = sorted(int(re.match(r"error: rank (\d+) ", l).group(1)) for l in errors)
    assert ranks == list(range(plan.world_size)) and all(" lost rank(s) " in l for l in errors), errors
    assert took_s < 10 + 30, took_s  # the timeout, plus the launcher reaping its ranks (a hang would be 60 s)


def test_two_hosts_started_one_after_another_train_like_one_host_and_one_never_started_is_named(tmp_path, one_host):
    """Hosts are started one after another, each with `hethub launch --no_ssh`: node 1's launch starts after node 0
    has waited past its collective timeout (hetero.timeout_s = 8 s; rank 0's note comes after 10 s), rank 0 having
    said whom it waits for, and the run trains exactly like the same plan on one host, over the link between the
    hosts. A host never started ends every rank that did after hetero.join_timeout_s, each with one line naming
    the ranks and their host."""
    plan, path, losses, _ = one_host
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"hetero": {"timeout_s": 8, "join_timeout_s": 600}}))
    train = [*TRAIN, "--steps", "3", "--deepspeed_config", str(config)]
    with two_hosts() as hosts:
        first = _start_on_hosts(hosts, path, [*train, "--log-json", str(tmp_path / "node0.json")], nodes=(0,))
        note = wait_for_line(first[0].stdout, r"^hethub: 2 ranks of 5 joined; waiting up to 600 s", timeout=120)
        assert "for rank(s) 2-4 (host big)" in note, note
        procs = first + _start_on_hosts(hosts, path, train, nodes=(1,))
        outs = _finish(procs, 240)
        assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-2000:] for o in outs)
        sent = [tx_bytes(h) for h in hosts]
        config.write_text(json.dumps({"hetero": {"join_timeout_s": 2}}))
        alone = _start_on_hosts(hosts, path, train, nodes=(0,))
        out = _finish(alone, 120)[0]
    # Rank 0 (on node 0) logs. Same plan, same ranks, same order of every sum: the same floats.
    assert _losses(tmp_path / "node0.json") == losses
    # Namespaces share no other path: every activation (and, back, its gradient) crossed this link, at
    # least 2 bytes a number: 3 steps x M micro-batches x b samples x seq x hidden.
    m = plan.model
    assert min(sent) >= 3 * plan.num_micro_batches * plan.micro_batch_size * m.seq_length * m.hidden_size * 2, sent
    assert alone[0].returncode == 3, out[-2000:]
    errors = sorted(l for l in out.splitlines() if l.startswith("error:"))
    assert errors == [f"error: rank {r}: rank(s) 2-4 (host big) did not join within hetero.join_timeout_s = 2 s: "
                      "start `hethub launch` on every host of the plan, with the same --master_addr and "
                      "--master_port" for r in (0, 1)], out[-2000:]


@pytest.mark.skipif(not UNSHARE_WORKS, reason="needs unshare for a mount namespace")
def test_a_checkpoint_directory_the_hosts_do_not_share_ends_every_rank_with_one_line(tmp_path):
    """Node 1 sees its own empty directory where node 0 saves: the save is refused on every rank (exit 2),
    naming the directory and the host that cannot see it, instead of a traceback on one host and a hang."""
    plan, path = _pair_plan(tmp_path)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    train = [*TRAIN, "--steps", "3", "--save-dir", str(ckpt), "--save-every", "1"]
    with two_hosts() as hosts:
        procs = _start_on_hosts(hosts, path, train, private_dir=str(ckpt))
        outs = _finish(procs, 240)
    assert [p.returncode for p in procs] == [2, 2], "\n".join(o[-2000:] for o in outs)
    lines = [l for o in outs for l in o.splitlines() if l.startswith("error:")]
    assert len(lines) == plan.world_size, "\n".join(o[-2000:] for o in outs)
    big = [r.rank for st in plan.stages for r in st.replicas if r.host == "big"]
    own = [l for l in lines if "is not shared by every host" in l]
    assert len(own) == len(big) and all("(host big) cannot see the directory rank 0 made there" in l for l in own), lines
    others = [l for l in lines if l not in own]
    assert others == [f"error: checkpoint: rank {big[0]} cannot see the checkpoint directory (see its message)"] * (
        plan.world_size - len(big)), lines
    assert not (ckpt / "latest").exists()  # nothing published


@pytest.mark.skipif(not UNSHARE_WORKS, reason="needs unshare for a mount namespace")
def test_hosts_that_see_checkpoints_of_different_steps_refuse_to_resume(tmp_path):
    """Each host holds a complete checkpoint, of different steps: every rank refuses to resume (exit 2)
    rather than training on from two different steps."""
    plan, path = _pair_plan(tmp_path)
    _train_here(tmp_path, path, plan.world_size)
    saved = tmp_path / "ckpt"
    ckpt, other = tmp_path / "resume", tmp_path / "other"
    shutil.copytree(saved, ckpt)
    shutil.copytree(saved, other)
    meta = other / "global_step3" / "meta.json"
    meta.write_text(json.dumps(dict(json.loads(meta.read_text()), global_steps=2)))
    with two_hosts() as hosts:
        procs = _start_on_hosts(hosts, path, [*TRAIN, "--steps", "5"], own_flags=("--resume", str(ckpt)),
                                private_dir=str(ckpt), private_source=str(other))
        outs = _finish(procs, 240)
    assert [p.returncode for p in procs] == [2, 2], "\n".join(o[-2000:] for o in outs)
    lines = [l for o in outs for l in o.splitlines() if l.startswith("error:")]
    assert len(lines) == plan.world_size and len(set(lines)) == 1, lines
    assert lines[0].startswith("error: checkpoint: ranks found checkpoints of different steps (2 to 3) in "), lines


def _elastic_plan(tmp_path) -> str:
    """Two hosts at ADDRS: FAST x2 and SLOW x2, planned (as a model big enough to use all four) for the stack."""
    from instances import two_host_cluster, write_elastic_plan
    return write_elastic_plan(two_host_cluster(ADDRS[0], ADDRS[1]), tmp_path / "plan.json")


def _elastic_start(host, plan: str, port: int, ckpt: str, log: str, last: int, hold: str = "-1:0"
                   ) -> subprocess.Popen:
    """hold "STEP:WORLD": a world smaller than WORLD waits before STEP (see tests/workers/elastic.py)."""
    cmd = ["ip", "netns", "exec", host.namespace, *_launch_cmd(plan), "--elastic", "--master_addr", ADDRS[0],
           "--master_port", str(port), "--checkpoint-dir", ckpt, "--checkpoint-every", "2", "--min-nodes", "1",
           "--max-restarts", "5", "--log-json", os.path.join(ckpt, "events.jsonl"),
           os.path.join("tests", "workers", "elastic.py"), log, str(last), "0.4", hold]
    return subprocess.Popen(cmd, env=dict(_env(), GLOO_SOCKET_IFNAME=host.interface), cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _power_off(host) -> None:
    """Every process in the host's namespace, killed at once (the agent runs in a session of its own)."""
    for pid in ip("netns", "pids", host.namespace).stdout.split():
        try:
            os.kill(int(pid), 9)
        except ProcessLookupError:
            continue  # it ended on its own meanwhile


def _steps(log: str) -> list[dict]:
    if not os.path.exists(log):
        return []
    with open(log) as f:
        return [json.loads(line) for line in f if line.strip()]


def _wait_for(log: str, ok, timeout_s: float, procs) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        hit = next((s for s in _steps(log) if ok(s)), None)
        if hit is not None:
            return hit
        time.sleep(0.2)
    outs = []
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, 9)
        outs.append(p.communicate()[0][-3000:])
    raise AssertionError(f"no such step within {timeout_s} s: {_steps(log)[-3:]}\n" + "\n---\n".join(outs))


@pytest.mark.slow
def test_elastic_launch_loses_a_host_replans_and_grows_back(tmp_path):
    """`hethub launch --elastic` on two hosts (torch's elastic agent, c10d rendezvous on the FAST host). The SLOW
    host's agent is killed mid-run: the FAST host's workers restart, re-plan for FAST alone and resume from the
    newest checkpoint; the SLOW host starts again and the job grows back to both. Every step's loss, repeated
    ones included, equals one process's on the same batches (float64); the re-plan and the regrowth each reach
    their first step within 30 s."""
    from dist_util import free_port
    plan, ckpt, log, last = _elastic_plan(tmp_path), str(tmp_path / "ckpt"), str(tmp_path / "steps.jsonl"), 26
    hold = "14:4"  # FAST alone waits before step 14, so the returning host finds the job mid-run however slow it starts
    ref = tmp_path / "ref.json"
    r = run_python([os.path.join("tests", "workers", "elastic.py"), "single", str(ref), str(last)], timeout=60)
    assert r.returncode == 0, r.stderr
    expect = {int(k): v for k, v in json.loads(ref.read_text())["losses"].items()}
    port = free_port()
    with two_hosts() as hosts:
        procs = [_elastic_start(h, plan, port, ckpt, log, last, hold) for h in hosts]
        _wait_for(log, lambda s: s["world"] == 4 and s["step"] >= 4, 180, procs)
        _power_off(hosts[1])  # the SLOW host: its launcher, agent and workers
        procs[1].wait()
        t_lost = time.time()
        alone = _wait_for(log, lambda s: s["world"] == 2, 60, procs)
        procs[1] = _elastic_start(hosts[1], plan, port, ckpt, log, last, hold)
        t_back = time.time()
        grown = _wait_for(log, lambda s: s["world"] == 4 and s["t"] > t_back, 90, procs)
        outs = _finish(procs, 180)
    assert [p.returncode for p in procs] == [0, 0], "\n---\n".join(o[-3000:] for o in outs)
    steps = _steps(log)
    for s in steps:
        assert s["loss"] == pytest.approx(expect[s["step"]], rel=1e-10), s
    assert {s["step"] for s in steps} == set(range(last))  # none skipped
    lost_step = max(s["step"] for s in steps if s["t"] < t_lost)
    assert alone["step"] >= lost_step - 3  # at most the checkpoint interval, plus the step a write has, done again
    print(f"loss -> first step on FAST alone: {alone['t'] - t_lost:.1f} s; return -> first step on both: "
          f"{grown['t'] - t_back:.1f} s")
    assert alone["t"] - t_lost <= 30 and grown["t"] - t_back <= 30, (alone["t"] - t_lost, grown["t"] - t_back)
    plans = sorted(os.listdir(os.path.join(ckpt, "plans")))
    assert "step-0.json" in plans and len(plans) >= 3, plans
    said = "\n".join(outs)
    assert f"lost {ADDRS[1]}; hosts missing: {ADDRS[1]}" in said and f"joined {ADDRS[1]}; every host present" in said
    events = _steps(os.path.join(ckpt, "events.jsonl"))  # --log-json: the same events, one JSON object each
    starts = [e for e in events if e["event"] == "plan"]
    assert starts[0]["lost"] == [] and any(e["lost"] == [ADDRS[1]] and e["replan_s"] <= 2 for e in starts), starts
    assert any(e["joined"] == [ADDRS[1]] for e in starts) and sum(e["event"] == "first_step" for e in events) >= 2
    assert len(re.findall(r"hethub elastic: first step under this plan \(step \d+\) [\d.]+ s after", said)) >= 2
