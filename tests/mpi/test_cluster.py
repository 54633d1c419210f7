"""Two nodes on this machine (jobs/cluster/up.sh): Slurm, MPI and a training job across them.

The module brings up a 2-node cluster once (namespaces on a private bridge, slurmctld in a namespace
of its own, a slurmd in each node; this process is the login node) and takes it down again
afterwards, also when a test or the start fails. It needs root; without it, or without a piece
(namespaces, a bridge, Slurm), it skips with the reason, and fails under CI (tests/components.py).
Every command runs under ``timeout``. Its names derive from the cluster's directory and its daemons
listen in their own namespaces, so it runs beside test_slurm.py's one-node Slurm
(jobs/ci/slurm_up.sh).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ..components import MISSING, ran, unavailable
from . import plain_loop
from .launcher import ROOT, WORKERS, run_mpi
from .test_reproducible import engine_state

COMPONENT = "Slurm cluster on one machine"
CLUSTER = ROOT / "jobs" / "cluster"
FINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
         "DEADLINE", "PREEMPTED"}
SIZES_RAN: set[int] = set()  # the node counts of the clusters this run brought up
SBIN = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])


def _why_not() -> str | None:
    """Why the cluster cannot be had here, or None when it may be (up.sh says more: exit 3)."""
    if os.geteuid() != 0:
        return "jobs/cluster/up.sh needs root (network namespaces, a bridge, mounts, slurmd)"
    missing = [t for t in ("ip", "unshare", "nsenter", "flock", "setsid", "timeout") if not shutil.which(t, path=SBIN)]
    if missing:
        return f"missing tools: {', '.join(missing)} (iproute2, util-linux, coreutils)"
    if not all(shutil.which(t, path=SBIN) for t in ("slurmctld", "slurmd", "sbatch", "srun")) \
            and shutil.which("apt-get") is None:
        return "Slurm (slurmctld, slurmd, slurm-client) is not installed and there is no apt-get"
    return None


class Cluster:
    """Commands on the login node (this machine, after ``source DIR/env.sh``) and inside the nodes."""

    def __init__(self, path: Path):
        self.dir = path
        # No SLURM_*, PMI or Open MPI settings of an enclosing job or test: only what env.sh sets.
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PMI_", "PMIX_", "OMPI_"))}
        env.update(PATH=SBIN, ZEROMPI_PYTHON=sys.executable,
                   PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
                   MPIR_CVAR_POLLS_BEFORE_YIELD="1", MPIR_CVAR_POSIX_POLL_FREQUENCY="1", PYTHONFAULTHANDLER="1")
        self.env = env

    def login(self, *cmd: str, limit: int = 60, env: dict | None = None) -> subprocess.CompletedProcess:
        """``cmd`` in a login shell of the cluster: env.sh sourced, in the repository."""
        script = 'source "$1/env.sh" && shift && exec "$@"'
        return subprocess.run(["timeout", str(limit), "bash", "-c", script, "login", str(self.dir), *cmd],
                              capture_output=True, text=True, cwd=ROOT, env={**self.env, **(env or {})},
                              timeout=limit + 10)

    def on(self, node: str, *cmd: str, limit: int = 30) -> subprocess.CompletedProcess:
        """``cmd`` inside ``node`` (jobs/cluster/exec.sh)."""
        return subprocess.run(["timeout", str(limit), "bash", str(CLUSTER / "exec.sh"), str(self.dir), node, *cmd],
                              capture_output=True, text=True, cwd=ROOT, env=self.env, timeout=limit + 10)

    def submit(self, *args: str, env: dict | None = None) -> str:
        """Submit a batch job (``sbatch ARGS``): its id."""
        proc = self.login("sbatch", "--parsable", *args, env=env)
        job = proc.stdout.strip().split(";")[0]
        assert proc.returncode == 0 and job.isdigit(), proc.stdout + proc.stderr
        return job

    def sbatch(self, *args: str, limit: float = 120, env: dict | None = None,
               log: Path | None = None) -> tuple[str, str]:
        """Submit a batch job and wait for its end: the job id and its final state.

        Polls squeue (which keeps finished jobs for 5 minutes) rather than sbatch --wait, whose
        polls back off to 10 s. Only a final state ends the wait: a squeue that times out
        under load prints nothing."""
        job = self.submit(*args, env=env)
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            state = self.login("squeue", "-h", "-j", job, "-t", "all", "-o", "%T", limit=30).stdout.strip()
            if state in FINAL:
                return job, state
            time.sleep(0.25)
        raise AssertionError(f"job {job} still {state or '?'} after {limit} s:\n{_stuck(self, job, log)}")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    yield from box(tmp_path_factory, 2)


def box(tmp_path_factory, nodes: int):
    """A cluster of ``nodes`` nodes for one module (its fixture yields from this), taken down after."""
    why = _why_not()
    if why:
        unavailable(COMPONENT, why)
    path = tmp_path_factory.mktemp("cluster")
    try:
        up = subprocess.run(["timeout", "300", "bash", str(CLUSTER / "up.sh"), str(path), "--nodes", str(nodes)],
                            capture_output=True, text=True, env={**os.environ, "PATH": SBIN})
        if up.returncode == 3:  # no root, a tool or a capability missing: up.sh says which
            unavailable(COMPONENT, up.stderr.strip()[-1000:])
        if up.returncode != 0:
            MISSING[COMPONENT] = f"up.sh failed ({up.returncode})"
            pytest.fail(f"jobs/cluster/up.sh failed ({up.returncode}):\n{up.stderr[-4000:]}")
        cluster = Cluster(path)
        version = cluster.login("sinfo", "--version").stdout.strip()
        sizes = sorted({nodes, *SIZES_RAN})
        SIZES_RAN.add(nodes)
        ran(COMPONENT, f"{version}, {' and '.join(map(str, sizes))} nodes (namespaces on a bridge), slurmctld in a "
                       "head namespace, a slurmd per node")
        yield cluster
    finally:
        down = subprocess.run(["timeout", "120", "bash", str(CLUSTER / "down.sh"), str(path)],
                              capture_output=True, text=True, env={**os.environ, "PATH": SBIN})
        assert down.returncode == 0, down.stderr


def test_srun_runs_on_two_nodes(cluster):
    proc = cluster.login("srun", "-N", "2", "-n", "2", "hostname")
    assert proc.returncode == 0, proc.stderr
    assert sorted(proc.stdout.split()) == ["node1", "node2"], proc.stdout + proc.stderr


HELLO_BATCH = """#!/bin/bash
exec "$MPIEXEC" -n 4 "$ZEROMPI_PYTHON" -m mpi4py.bench helloworld
"""


@pytest.mark.parametrize("launch", ("srun", "mpiexec"))
def test_mpi4py_two_nodes_two_ranks_each(cluster, tmp_path, launch):
    """One MPI job of 4 ranks, 2 on each node: by srun --mpi=pmi2, and by hydra's mpiexec inside an
    allocation (it starts its proxies on the nodes with srun: there is no ssh)."""
    if launch == "srun":
        proc = cluster.login("srun", "-N", "2", "--ntasks-per-node=2", "--mpi=pmi2",
                             sys.executable, "-m", "mpi4py.bench", "helloworld")
        assert proc.returncode == 0, proc.stderr
        out = proc.stdout
    else:
        mpiexec = Path(sys.executable).with_name("mpiexec")
        if not mpiexec.exists():
            pytest.skip(f"no MPICH mpiexec beside {sys.executable}")
        script, log = tmp_path / "hello.sbatch", tmp_path / "hello.out"
        script.write_text(HELLO_BATCH)
        job, state = cluster.sbatch("-N", "2", "--ntasks-per-node=2", f"--output={log}", str(script),
                                    env=dict(MPIEXEC=str(mpiexec)))
        out = log.read_text() if log.exists() else ""
        assert state == "COMPLETED", f"job {job} {state}:\n{out[-4000:]}"
    lines = sorted(line for line in out.splitlines() if line.startswith("Hello"))
    assert lines == [f"Hello, World! I am process {r} of 4 on node{1 + r // 2}." for r in range(4)], out


def test_node_scratch_is_private_and_shared_is_common(cluster):
    shared = cluster.dir / "shared"
    for node in ("node1", "node2"):
        proc = cluster.on(node, "sh", "-c", f"hostname > /scratch/local/mine && hostname > {shared}/from-$(hostname)")
        assert proc.returncode == 0, proc.stderr
    for node, other in (("node1", "node2"), ("node2", "node1")):
        proc = cluster.on(node, "sh", "-c", f"ls /scratch/local; cat /scratch/local/mine {shared}/from-{other}")
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.split() == ["mine", node, other], proc.stdout  # its own file only; the other's shared one
        assert (cluster.dir / "nodes" / node / "scratch" / "mine").read_text().strip() == node
    assert not (Path("/scratch/local") / "mine").exists()  # the login node does not see the nodes' disks
    # Jobs see the same: srun's tasks on each node list their own node's scratch.
    proc = cluster.login("srun", "-N", "2", "-n", "2", "sh", "-c", 'echo "$(hostname) $(cat /scratch/local/mine)"')
    assert sorted(proc.stdout.splitlines()) == ["node1 node1", "node2 node2"], proc.stdout + proc.stderr


def test_train_multinode_sbatch(cluster, tmp_path):
    """jobs/slurm/train_multinode.sbatch on 2 nodes x 2 ranks: the engine finds the nodes from MPI
    (not ranks_per_node) and shards within a node (hsdp); sacct reads the job's end from the log."""
    config = tmp_path / "hsdp.toml"
    config.write_text((ROOT / "jobs/configs/tiny.toml").read_text().replace("[zero]\n", '[zero]\nhierarchy = "hsdp"\n'))
    out_dir, log = cluster.dir / "shared" / "out", tmp_path / "train.out"
    # The script asks for 4 CPUs per task; the nodes have this machine's few.
    job, state = cluster.sbatch("-N", "2", "--ntasks-per-node=2", "--cpus-per-task=1", "--time=5",
                                f"--output={log}", "jobs/slurm/train_multinode.sbatch",
                                "--config", str(config), "--steps", "4", "--out", str(out_dir), limit=240, log=log)
    text = log.read_text() if log.exists() else ""
    assert state == "COMPLETED", f"job {job} {state}:\n{text[-4000:]}"
    assert "topology: world size 4 on 2 nodes x 2 ranks (node1, node2), hierarchy hsdp" in text, text[-4000:]
    assert "done: 4 steps, world size 4" in text, text[-4000:]
    assert (out_dir / "metrics.jsonl").is_file()
    sacct = cluster.login("sacct", "-n", "-P", "-j", job, "-o", "JobID,State,NNodes")
    assert sacct.returncode == 0 and f"{job}|COMPLETED|2" in sacct.stdout, sacct.stdout + sacct.stderr


REPRO_ROWS = ("3-fp32-none-False-noclip", "2-bf16-none-False-noclip")  # stage 3 fp32, stage 2 bf16


def _on_two_nodes(cluster, script: Path, *args, limit: int = 240) -> subprocess.CompletedProcess:
    """``script`` on 2 nodes x 2 ranks by srun --mpi=pmi2 (MPICH's PMI-2 from slurmd)."""
    proc = cluster.login("srun", "-N", "2", "--ntasks-per-node=2", "--mpi=pmi2", sys.executable, "-m", "mpi4py",
                         str(script), *map(str, args), limit=limit, env=dict(OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    return proc


def test_reproducible_two_nodes_train_the_bits_of_one_node_and_of_the_plain_loop(cluster, tmp_path):
    """reproducible=True across a node link: workers/reproducible.py on 2 nodes x 2 ranks (srun
    --mpi=pmi2 inside the cluster, so the ranks of different nodes talk over eth0, not shared
    memory) ends in the same per-step digests as on 1 node x 4 ranks (plain mpiexec on this
    machine, outside the cluster), and its final state is bit for bit the plain single-process
    PyTorch loop's (tests/mpi/plain_loop.py). Guards against bits that depend on where the ranks
    sit (a transport's reduction order, a node-dependent split)."""
    rows = ",".join(REPRO_ROWS)
    two = cluster.dir / "shared" / "repro-2x2.json"
    _on_two_nodes(cluster, WORKERS / "reproducible.py", "--out", two, "--rows", rows)
    one = tmp_path / "repro-1x4.json"
    run_mpi(4, "reproducible.py", "--out", str(one), "--rows", rows, timeout=300)
    two, one = json.loads(two.read_text()), json.loads(one.read_text())
    assert two["world"] == one["world"] == 4
    for key in REPRO_ROWS:
        a, b = two["rows"][key], one["rows"][key]
        assert a["steps"] == b["steps"] and a["digest"] == b["digest"], key  # every step's digest
        assert a["norms"] == b["norms"], key
        ref = plain_loop.train(torch.float32 if "fp32" in key else torch.bfloat16, None)
        for label, got in engine_state(a).items():
            want = ref["state"][label.removesuffix("/master")].flatten()
            assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (key, label)


NVME_ROWS = ("2-fp32-nvme-False", "3-bf16-nvme-True")  # optimizer state (stage 2), parameters too (stage 3)


def test_nvme_offload_on_node_local_scratch_trains_the_bits_of_one_node(cluster, tmp_path):
    """NVMe offload with nvme_path on each node's own scratch disk (/scratch/local, which only that node
    sees): on 2 nodes x 2 ranks the NVMe rows of workers/reproducible.py train the per-step digests of
    the same rows on 1 node x 4 ranks swapping to this machine's temp dir, and every rank's swap file
    lived on its own node's disk (ranks 0-1 on node1's, 2-3 on node2's), removed at close."""
    rows = ",".join(NVME_ROWS)
    two = cluster.dir / "shared" / "nvme-2x2.json"
    _on_two_nodes(cluster, WORKERS / "reproducible.py", "--out", two, "--rows", rows, "--swap", "/scratch/local/swap")
    one = tmp_path / "nvme-1x4.json"
    run_mpi(4, "reproducible.py", "--out", str(one), "--rows", rows, timeout=300)
    two, one = json.loads(two.read_text()), json.loads(one.read_text())
    for key in NVME_ROWS:
        a, b = two["rows"][key], one["rows"][key]
        assert a["steps"] == b["steps"] and a["digest"] == b["digest"], key
        assert [s["host"] for s in a["swap"]] == ["node1", "node1", "node2", "node2"], a["swap"]
        assert all(s["path"].startswith("/scratch/local/swap/") and s["bytes"] > 0 for s in a["swap"]), a["swap"]
    for node in ("node1", "node2"):  # each node's disk held its ranks' files only while they ran
        assert list((cluster.dir / "nodes" / node / "scratch" / "swap").iterdir()) == [], node


LINK_SLACK = 128 * 1024  # bytes: barriers, Slurm's own messages to the head, in the measured window


def link_bounds(hierarchy: str, padded: int, steps: int, ranks_per_node: int = 2, nodes: int = 2) -> tuple[int, int]:
    """The bytes one node's link carries in each direction over ``steps`` steps of stage 3, fp32,
    one micro-batch a rank, 2 nodes (the README's formula, [Node-aware groups]): the least any
    algorithm can send, and the most MPICH's do.

    hsdp: only the gradient shards (P/s elements a rank) cross, all-reduced in fp32 between the
    rank's 2 peers: any 2-rank all-reduce sends exactly its buffer, so s P/s 4 = 4P bytes a step.
    hpZ: the gradient reduce-scatter over the world group crosses (the node holds half the
    shards: at least P/2 elements must come in, P c when each block goes straight to its owner,
    MPICH's pairwise exchange for large buffers), and the secondary copy's refresh, one all-gather
    over the inter group of each rank's P/N primary shard: s P/N c = P c / 2. The forward and
    backward gathers stay inside the node; were they over the world, each would add at least
    P c / 2 (half of the parameters live on the other node), 2 of them P c a step: above the
    upper bound (1.5 P c, times 1.05 for headers)."""
    assert nodes == 2 and ranks_per_node == 2
    c = 4
    if hierarchy == "hsdp":
        return 4 * padded * steps, 4 * padded * steps
    return (padded // 2 + padded // 2) * c * steps, (padded + padded // 2) * c * steps


def test_hsdp_and_hpz_parameter_gathers_never_cross_a_node_link(cluster):
    """hsdp and hpZ at stage 3 on 2 nodes x 2 ranks (workers/cluster_links.py): the bytes each
    node's eth0 counted (its own kernel counters, read inside the node, not the engine's
    accounting) over 4 steps after 2 warm-up ones lie within link_bounds: the gradients' share and
    (hpZ) the secondary copy's refresh, never the parameter gathers. Guards the groups of
    zerompi/comm/topology.py and hpZ's NodeCopy (shard/sync.py)."""
    out = cluster.dir / "shared" / "links.json"
    _on_two_nodes(cluster, WORKERS / "cluster_links.py", "--out", out, "--steps", "4")
    rows = json.loads(out.read_text())["rows"]
    assert [r["hierarchy"] for r in rows] == ["hsdp", "hpz"]
    for r in rows:
        low, high = link_bounds(r["hierarchy"], r["padded"], r["steps"])
        for way in ("tx", "rx"):
            assert sorted(r[way]) == ["node1", "node2"], r
            for node, got in r[way].items():
                assert low <= got <= high * 1.05 + LINK_SLACK, (r["hierarchy"], node, way, got, low, high, r)


def test_checkpoint_saved_on_two_nodes_resumes_on_one_node_at_three_ranks(cluster):
    """A checkpoint written by 2 nodes x 2 ranks to the shared disk (DIR/shared, per-rank files from
    both nodes) resumes on 1 node at 3 ranks (srun -N 1 -n 3 --overcommit: a node declares this
    machine's 2 CPUs) and ends in the plain loop's bits
    (workers/reproducible.py: saved after 2 of its steps, the rest trained after the load). Guards
    a checkpoint that holds only one node's shards, or that reloads at another world size wrongly."""
    key = REPRO_ROWS[0]
    ckpt, saved = cluster.dir / "shared" / "ckpt", cluster.dir / "shared" / "saved.json"
    _on_two_nodes(cluster, WORKERS / "reproducible.py", "--out", saved, "--rows", key, "--save-after", "2",
                  "--ckpt", ckpt)
    resumed = cluster.dir / "shared" / "resumed.json"
    proc = cluster.login("srun", "-N", "1", "-n", "3", "--overcommit", "--mpi=pmi2", sys.executable, "-m", "mpi4py",
                         str(WORKERS / "reproducible.py"), "--out", str(resumed), "--rows", key, "--resume", str(ckpt),
                         limit=240, env=dict(OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    row = json.loads(resumed.read_text())
    assert row["world"] == 3
    assert_plain_loop_bits(row["rows"][key])


def assert_plain_loop_bits(row: dict) -> None:
    """A fp32 row of workers/reproducible.py ends in the plain PyTorch loop's bits (tests/mpi/plain_loop.py)."""
    ref = plain_loop.train(torch.float32, None)
    state = engine_state(row)
    assert state
    for label, got in state.items():
        want = ref["state"][label.removesuffix("/master")].flatten()
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), label


TRAIN_BATCH = """#!/bin/bash
hang_dir="$CLUSTER_SHARED/hang-$SLURM_JOB_ID"
$LAUNCH "$ZEROMPI_PYTHON" -m mpi4py tests/mpi/workers/cluster_links.py --out "$CLUSTER_SHARED/never.json" \\
    --steps 1000000 --hierarchies hsdp --started "$STARTED" --hang-dir "$hang_dir" $EXTRA
status=$?
echo "launcher returned at $(date +%s.%N)"
# as jobs/slurm/train.sbatch does after a failed run (nothing where the hang report was printed)
"$ZEROMPI_PYTHON" -m zerompi.tools.cli diagnose --wait 10 --if-unreported "$hang_dir"
echo "mpiexec exit $status"
"""
# how jobs/slurm/train.sbatch starts the ranks with ZEROMPI_LAUNCH=srun (its default)
SRUN_LAUNCH = "srun --mpi=pmi2 --kill-on-bad-exit=1 --wait=10"


def _training(cluster, tmp_path, *extra: str, launch: str | None = None) -> tuple[str, Path]:
    """A 2 x 2 job (sbatch; hydra's mpiexec, or ``launch``) that trains until something stops it, once past
    its warm-up steps: its id and its log."""
    mpiexec = Path(sys.executable).with_name("mpiexec")
    if launch is None and not mpiexec.exists():
        pytest.skip(f"no MPICH mpiexec beside {sys.executable}")
    script, log, started = tmp_path / "train.sbatch", tmp_path / "train.out", tmp_path / "started"
    script.write_text(TRAIN_BATCH)
    job = cluster.submit("-N", "2", "--ntasks-per-node=2", "--time=5", f"--output={log}", str(script),
                         env=dict(LAUNCH=launch or f"{mpiexec} -n 4", STARTED=str(started), EXTRA=" ".join(extra),
                                  OMP_NUM_THREADS="1"))
    _until(lambda: started.exists(), 180, f"job {job} did not start training", cluster, job, log)
    return job, log


def _until(cond, limit: float, what: str, cluster=None, job: str | None = None, log: Path | None = None) -> float:
    """Wait up to ``limit`` s for ``cond()``; the seconds it took (else cancel ``job`` and fail)."""
    start = time.monotonic()
    while time.monotonic() - start < limit:
        if cond():
            return time.monotonic() - start
        time.sleep(0.2)
    if job:
        raise AssertionError(f"{what} within {limit} s:\n{_stuck(cluster, job, log)}")
    raise AssertionError(f"{what} within {limit} s:\n{log.read_text()[-4000:] if log and log.exists() else ''}")


def _stuck(cluster, job: str, log: Path | None) -> str:
    """Where a job that should have ended stands, then cancel it: its processes, the Python stacks of
    its ranks (SIGABRT to its steps; Cluster sets PYTHONFAULTHANDLER), its log's tail, Slurm's account."""
    ps = subprocess.run(["ps", "-eo", "pid,ppid,stat,wchan:24,etime,args"], capture_output=True, text=True).stdout
    procs = [line[:240] for line in ps.splitlines() if re.search(r"slurmstepd|srun|mpiexec|hydra|mpi4py", line)]
    slurm = _slurm_account(cluster, job)
    cluster.login("scancel", "--signal=ABRT", job, limit=20)
    time.sleep(3)
    cluster.login("scancel", job, limit=20)
    text = log.read_text(errors="replace")[-8000:] if log and log.exists() else "(no log)"
    return f"--- processes:\n" + "\n".join(procs) + f"\n--- log (after SIGABRT to the steps):\n{text}{slurm}"


def _slurm_account(cluster, job: str) -> str:
    """What Slurm says of ``job``: its record and the controller's log lines that name it, nodes' states."""
    show = cluster.login("scontrol", "show", "job", job, limit=20)
    nodes = cluster.login("sinfo", "-N", "-h", "-o", "%N %T %E", limit=20)
    ctld = cluster.dir / "slurm" / "slurmctld.log"
    lines = [line for line in ctld.read_text(errors="replace").splitlines()
             if f"JobId={job}" in line or f"job {job}" in line.lower() or "node2" in line] if ctld.exists() else []
    slurmd = cluster.dir / "nodes" / "node1" / "slurmd.log"
    node1 = [line for line in slurmd.read_text(errors="replace").splitlines()
             if "debug" not in line][-20:] if slurmd.exists() else []
    return (f"\n--- scontrol show job {job}:\n{show.stdout}{show.stderr}--- sinfo:\n{nodes.stdout}"
            f"--- slurmctld.log (this job, node2):\n" + "\n".join(lines[-40:])
            + "\n--- node1's slurmd.log:\n" + "\n".join(node1))


def _names(cluster) -> tuple[str, str]:
    """The prefix of the cluster's names (jobs/cluster/lib.sh) and node2's holder pid."""
    prefix = "zc" + hashlib.sha1(str(cluster.dir.resolve()).encode()).hexdigest()[:6]
    return prefix, (cluster.dir / "nodes" / "node2" / "holder.pid").read_text().strip()


def _final(cluster, job: str) -> bool:
    state = cluster.login("squeue", "-h", "-j", job, "-t", "all", "-o", "%T", limit=30).stdout.strip()
    return state in FINAL


def _stop_then_kill(net: int, spared: tuple[str, ...]) -> list[int]:
    """SIGSTOP every process in network namespace ``net`` but those whose command is in ``spared``, listing
    again until no new one appears (at most 5 rounds: a process forked meanwhile), then SIGKILL them all:
    no victim acts between the first kill and the last (a watcher writing that its rank died alone, a rank
    answering a look). A process that ended between the listing and its signal is passed over."""
    stopped: list[int] = []
    for _ in range(5):
        found = []
        for entry in Path("/proc").iterdir():
            try:
                if entry.name.isdigit() and int(entry.name) not in stopped \
                        and os.stat(entry / "ns" / "net").st_ino == net \
                        and (entry / "comm").read_text().strip() not in spared:
                    os.kill(int(entry.name), signal.SIGSTOP)
                    found.append(int(entry.name))
            except OSError:  # ended meanwhile (ProcessLookupError, FileNotFoundError)
                continue
        stopped += found
        if not found:
            break
    killed = []
    for pid in stopped:
        try:
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        except ProcessLookupError:
            continue
    return killed


def kill_the_jobs_processes_on_node2(cluster) -> None:
    """Kill every process of the job on node2 at once (its slurmstepd, hydra's proxy or Open MPI's prted, its
    ranks: _stop_then_kill); node2's slurmd stays, so the node itself is there for the module's next jobs."""
    _, holder = _names(cluster)
    killed = _stop_then_kill(os.stat(f"/proc/{holder}/ns/net").st_ino, ("slurmd", "sleep"))  # the node, not the job
    assert len(killed) >= 3, killed  # slurmstepd, the proxy (hydra's or prted), 2 ranks


def test_node_lost_ends_the_job_within_30_s(cluster, tmp_path):
    """Node2 lost in the middle of training, without ULFM: every process of the job on node2 (its
    slurmstepd, hydra's proxy, ranks 2 and 3) SIGKILLed at once. The job (2 x 2 by hydra's mpiexec
    inside sbatch) must end, with mpiexec's nonzero exit returned within 30 s, not hold its nodes. Hydra names
    neither node2 nor its ranks ("control_cb ... assert (!closed) failed"); the end report does (zerompi
    diagnose on the watchers' end records in the shared hang_dir): node2 lost with ranks 2-3, ranks 0-1
    torn down by the launcher. Break guarded: no record of a torn-down rank (nothing tells a lost node
    from a silent one); the report's rules are tests/unit/comm/test_ends.py's."""
    job, log = _training(cluster, tmp_path)
    try:
        killed = time.time()
        kill_the_jobs_processes_on_node2(cluster)
        # the bound is on the launcher; after it the script's end report (diagnose, up to 10 s of settling
        # and a Python start) and Slurm's end of the job take what a loaded machine gives them
        took = _until(lambda: "mpiexec exit" in log.read_text() and _final(cluster, job), 120,
                      "the job did not end after node2 was lost", cluster, job, log)
    finally:
        cluster.login("scancel", job)
    text = log.read_text()
    returned = float(re.search(r"launcher returned at ([0-9.]+)", text).group(1))
    assert returned - killed < 30, f"hydra's mpiexec returned {returned - killed:.1f} s after the kill"
    assert "mpiexec exit 0" not in text, text[-4000:]
    report = text[text.index("zerompi end report"):] if "zerompi end report" in text else text[-4000:]
    assert "zerompi end report: 4 ranks, 2 left an end record" in report, report
    assert "lost: node2 (rank(s) 2-3)" in report, report
    assert "torn down by the launcher: rank(s) 0-1 on node1" in report, report
    assert "died alone" not in report, report
    print(f"job {job}: its launcher returned {returned - killed:.1f} s and the job ended {took:.1f} s after "
          "node2's processes were killed")


def test_node_lost_under_srun_ends_the_job_and_names_the_node(cluster, tmp_path):
    """The same loss under srun --mpi=pmi2, train.sbatch's default launch. Nothing tears the survivors
    down: ranks 0-1 wait in a collective until their watchdog fires (hang_floor 3 s); MPICH then either
    lets the hang report through (it names node2 unreachable) or crashes in the side channel's send to a
    dead rank (each survivor's watcher records it as died alone, and the end report names node2 lost).
    srun itself waits for node2's slurmstepd until Slurm declares the node dead (SlurmdTimeout, minutes)
    unless ``--wait`` bounds its wait after the first task's end, as train.sbatch's does (ZEROMPI_SRUN_WAIT,
    here 10 s): the job must end within 60 s, naming node2 and its ranks. Break guarded: srun without
    --wait (the job outlives the bound)."""
    assert '--wait="${ZEROMPI_SRUN_WAIT:-30}"' in (ROOT / "jobs" / "slurm" / "train.sbatch").read_text()
    job, log = _training(cluster, tmp_path, "--hang-floor", "3", launch=SRUN_LAUNCH)
    try:
        kill_the_jobs_processes_on_node2(cluster)
        took = _until(lambda: "mpiexec exit" in log.read_text(), 60, "the job did not end after node2 was lost",
                      cluster, job, log)
    finally:
        cluster.login("scancel", job)
    text = log.read_text()
    assert "mpiexec exit 0" not in text, text[-4000:]
    assert "lost: node2 (rank(s) 2-3)" in text or "unreachable: node2 (rank(s) 2-3)" in text, text[-6000:]
    print(f"job {job} ended {took:.1f} s after node2's processes were killed")


def test_cut_link_is_a_hang_report_naming_the_unreachable_nodes_ranks(cluster, tmp_path):
    """Node2's link cut in the middle of training (`ip link set` of its veth down on the bridge
    side, in place of netem's packet loss): nothing is reset, the ranks of node1 wait in the
    cross-node all-reduce, and the watchdog (hang_floor 3 s) prints a hang report naming ranks
    2-3, node2's, as the missing culprits, and node2 as unreachable, then aborts. Guards the
    watchdog's report when ranks are unreachable rather than dead: the hosts it names are the ones
    every rank gave when the watchdog started (a missing rank sends no record)."""
    job, log = _training(cluster, tmp_path, "--hang-floor", "3")
    prefix, _ = _names(cluster)
    veth = f"{prefix}v2"
    subprocess.run(["ip", "link", "set", veth, "down"], check=True, timeout=30)
    try:
        _until(lambda: "\nculprit:" in log.read_text(), 120, "no hang report", cluster, job, log)
    finally:
        subprocess.run(["ip", "link", "set", veth, "up"], check=True, timeout=30)
    try:
        _until(lambda: _final(cluster, job), 90, "the job did not end after its hang report", cluster, job, log)
    finally:
        cluster.login("scancel", job)
    text = log.read_text()
    assert "zerompi hang report: 4 ranks, 2 answered" in text, text[-4000:]
    assert "\n  rank(s) 2-3: missing on node2\n" in text, text[-4000:]
    assert "\nunreachable: node2 (rank(s) 2-3): none of its ranks answered" in text, text[-4000:]
    # Ranks 2-3 are culprits whatever node1's ranks did: all at one collective (then the missing
    # ones are the culprits), or apart (node1's rank 0 got past an all-reduce with rank 2 before the
    # cut that rank 1's with rank 3 did not: the missing ranks are added to whoever is named).
    named = re.search(r"^culprit: rank\(s\) ([0-9, -]+) \(", text, re.M)
    assert named, text[-4000:]
    ranks = {r for part in named.group(1).split(",") for a, _, b in [part.strip().partition("-")]
             for r in range(int(a), int(b or a) + 1)}
    assert {2, 3} <= ranks, text[-4000:]


REQUEUE_BATCH = """#!/bin/bash
echo "start: restart ${SLURM_RESTART_COUNT:-0} on $SLURM_JOB_NODELIST, $SLURM_NTASKS ranks"
"$MPIEXEC" -n "$SLURM_NTASKS" "$ZEROMPI_PYTHON" jobs/train_gpt.py --config jobs/configs/tiny.toml --reproducible \\
    --micro-batches 4 --steps 40 --save-every 2 --keep-last 2 --resume --out "$OUT"
code=$?
echo "mpiexec exit $code"
# A failed run waits: Slurm requeues a job that a node failure ends, not one whose script has ended first.
[ "$code" = 0 ] || sleep 120
"""
REQUEUE_FLAGS = ("--reproducible", "--micro-batches", "4", "--steps", "40")


def _kill_node2_processes(cluster) -> int:
    """Kill every process in node2's network namespace at once, its slurmd too (_stop_then_kill): the node is
    gone for Slurm (it answers nothing) and for the job; only the holder of its namespaces stays."""
    _, holder = _names(cluster)
    return len(_stop_then_kill(os.stat(f"/proc/{holder}/ns/net").st_ino, ("sleep",)))


def test_a_requeue_job_whose_node_dies_resumes_from_its_last_checkpoint_on_the_node_left(cluster, tmp_path):
    """``sbatch --requeue -N 1-2 -n 4 --spread-job --overcommit``: the main job in reproducible mode on
    2 nodes x 2 ranks, checkpointing every 2 steps; once it has a checkpoint, node2 dies (every process of
    it SIGKILLed, its slurmd too, and Slurm marks it DOWN at once instead of after its timeout). Slurm
    requeues the job; it restarts on node1 alone (its 4 ranks overcommitted: a requeued job keeps its task
    count), resumes from its last checkpoint and finishes, and its last step's loss is the one an
    uninterrupted 2-rank run of the same global batch reaches (reproducible: the bits do not depend on the
    world size). Slurm holds a requeued job 121 s (BeginTime, for the old credential to expire); the test
    releases it (``scontrol update JobId=... StartTime=now``) in a later second than node1 revoked that
    credential in. Node2 (a new slurmd) is returned to service after."""
    mpiexec = Path(sys.executable).with_name("mpiexec")
    if not mpiexec.exists():
        pytest.skip(f"no MPICH mpiexec beside {sys.executable}")
    out, log, script = cluster.dir / "shared" / "requeue", tmp_path / "requeue.out", tmp_path / "requeue.sbatch"
    script.write_text(REQUEUE_BATCH)
    job = cluster.submit("--requeue", "--open-mode=append", "-N", "1-2", "-n", "4", "--spread-job", "--overcommit",
                         "--time=10", f"--output={log}", str(script),
                         env=dict(MPIEXEC=str(mpiexec), OUT=str(out), OMP_NUM_THREADS="1"))
    try:
        _until(lambda: (out / "checkpoints" / "latest").exists(), 180, "no checkpoint", cluster, job, log)
        assert "on node[1-2], 4 ranks" in log.read_text(), log.read_text()[-3000:]
        assert _kill_node2_processes(cluster) >= 3  # slurmd, the job's proxy and ranks
        cluster.login("scontrol", "update", "NodeName=node2", "State=DOWN", "Reason=lost")  # at once, not in minutes
        held, released = [], []

        def restarted() -> bool:  # release the requeued job from its hold in the second after it is seen in it
            if not held and "BeginTime" in cluster.login("squeue", "-h", "-j", job, "-o", "%r").stdout:
                held.append(time.time())
            # node1's slurmd refuses a credential made in the second in which it revoked the job's old one
            # ("Killing non-startable batch job: Job credential revoked"), which is before the requeue:
            # the hold exists for that. A later second is enough.
            if held and not released and time.time() >= int(held[0]) + 1.1:
                if cluster.login("scontrol", "update", f"JobId={job}", "StartTime=now").returncode == 0:
                    released.append(True)
            return "restart 1 on node1, 4 ranks" in log.read_text()
        # under load the requeue waits for node2's end of the job to be given up: minutes, not seconds
        _until(restarted, 300, "no restart on node1", cluster, job, log)
        _until(lambda: _final(cluster, job), 300, "the restarted job did not end", cluster, job, log)
    finally:
        cluster.login("scancel", job)
        conf = cluster.login("printenv", "SLURM_CONF").stdout.strip()
        cluster.on("node2", "env", "-i", "PATH=/usr/sbin:/usr/bin:/sbin:/bin", "HOME=/root", "slurmd", "-f", conf,
                   "-N", "node2")  # as up.sh starts it
        cluster.login("scontrol", "update", "NodeName=node2", "State=RESUME")
        _until(lambda: cluster.login("sinfo", "-h", "-n", "node2", "-o", "%t").stdout.strip() in ("idle", "mix"),
               120, "node2 did not return to service")
    text = log.read_text()
    assert "resumed from" in text and "mpiexec exit 0" in text and "done: 40 steps, world size 4" in text, text[-4000:]
    straight = tmp_path / "straight"
    run_mpi(2, "jobs/train_gpt.py", "--config", "jobs/configs/tiny.toml", *REQUEUE_FLAGS,
            "--out", str(straight), timeout=300)
    last = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][-1]
    want = [json.loads(line) for line in (straight / "metrics.jsonl").read_text().splitlines()][-1]
    assert last["step"] == want["step"] == 40 and last["loss"] == want["loss"], (last, want)
