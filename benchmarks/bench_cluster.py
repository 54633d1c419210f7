"""Speed across node links: zerompi's stages and hierarchies beside DDP, FSDP2 and DeepSpeed on real
(namespaced) nodes with shaped links, and an alpha-beta model fitted to them.

For each node count in ``--nodes`` and link rate in ``--mbit`` it starts a cluster with
``jobs/cluster/up.sh DIR --nodes R --link-mbit M [--latency-us L]`` (every node's link shaped in both
directions by tbf; with L, every packet a node sends delayed by L, which needs the kernel's sch_netem),
runs ``--rounds`` rounds, each one launch per
family (zerompi, torch, deepspeed; their order rotates round to round), and takes the cluster down
(``down.sh``, also after an error or a signal). Each launch is ``srun -N R --ntasks-per-node=s
--mpi=pmi2`` of benchmarks/workers/cluster_worker.py, whose docstring lists the rows and how step time
and the links' byte counters are read. Every row result is a line of ``results/cluster.jsonl``;
benchmarks/peers/cluster_report.py then writes ``results/cluster.md``: the table, the model, its check
on points it was not fitted on, and a projection to 64 and 1,024 ranks.

    sudo .venv/bin/python benchmarks/bench_cluster.py [--nodes 2,4] [--mbit 1000,10000] [--latency-us 0]
        [--per-node 2] [--rounds 3] [--steps 5] [--families zerompi,torch,deepspeed] [--report-only]

Needs root (namespaces, tc, slurmd); exits 3 saying why otherwise. All nodes share this machine's
cores: R x s ranks on 2 cores run their compute R x s / 2 times slower than on a node of their own,
which the model keeps apart from the links' share (cluster_report.py).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from harness import stamp  # noqa: E402
from harness.paths import ROOT  # noqa: E402
from peers import cluster_report  # noqa: E402

CLUSTER = ROOT / "jobs" / "cluster"
WORKER = HERE / "workers" / "cluster_worker.py"
OUT = HERE / "results" / "cluster.jsonl"
SBIN = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])


def login_env() -> dict:
    """A login node's environment: no Slurm, PMI or Open MPI settings of an enclosing job."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PMI_", "PMIX_", "OMPI_"))}
    env.update(PATH=SBIN, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT),
               MPIR_CVAR_POLLS_BEFORE_YIELD="1", MPIR_CVAR_POSIX_POLL_FREQUENCY="1")
    return env


def on_login(directory: Path, cmd: list[str], limit: float, env: dict) -> subprocess.CompletedProcess:
    script = 'source "$1/env.sh" && shift && exec "$@"'
    return subprocess.run(["timeout", str(int(limit)), "bash", "-c", script, "login", str(directory), *cmd],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=limit + 30)


def launch(directory: Path, nodes: int, per_node: int, family: str, args, env: dict) -> dict:
    """One family's rows in one srun; the worker's JSON (or the launch's error)."""
    out = directory / "shared" / f"{family}.json"
    out.unlink(missing_ok=True)
    port = random.randint(20000, 40000)  # a fresh rendezvous port for each launch's gloo group
    cmd = ["srun", "-N", str(nodes), f"--ntasks-per-node={per_node}", "--mpi=pmi2", sys.executable, "-m", "mpi4py",
           str(WORKER), "--family", family, "--size", args.size, "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--out", str(out), *(["--rows", args.rows] if args.rows else [])]
    started = time.monotonic()
    proc = on_login(directory, cmd, args.limit, {**env, "MASTER_ADDR": "node1", "MASTER_PORT": str(port)})
    took = time.monotonic() - started
    if proc.returncode != 0 or not out.exists():
        return dict(error=f"srun exit {proc.returncode} after {took:.0f} s: {(proc.stderr or proc.stdout)[-600:]}")
    return json.loads(out.read_text()) | dict(launch_s=took)


def cluster_up(directory: Path, nodes: int, mbit: int, latency: int) -> None:
    cmd = ["timeout", "300", "bash", str(CLUSTER / "up.sh"), str(directory), "--nodes", str(nodes),
           "--link-mbit", str(mbit), *(["--latency-us", str(latency)] if latency else [])]
    up = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PATH": SBIN})
    if up.returncode != 0:
        raise SystemExit(f"up.sh exit {up.returncode}:\n{up.stderr[-3000:]}")


def cluster_down(directory: Path) -> None:
    subprocess.run(["timeout", "120", "bash", str(CLUSTER / "down.sh"), str(directory)],
                   capture_output=True, text=True, env={**os.environ, "PATH": SBIN})


def run(args) -> None:
    run_id = stamp.utc_now()
    env = login_env()
    lines = []
    for nodes in args.nodes:
        for mbit in args.mbit:
            directory = Path(args.dir) / f"n{nodes}-m{mbit}"
            directory.mkdir(parents=True, exist_ok=True)
            cluster_up(directory, nodes, mbit, args.latency_us)
            try:
                for rnd in range(args.rounds):
                    order = args.families[rnd % len(args.families):] + args.families[:rnd % len(args.families)]
                    for family in order:
                        got = launch(directory, nodes, args.per_node, family, args, env)
                        base = dict(kind="row", run=run_id, nodes=nodes, per_node=args.per_node, mbit=mbit,
                                    latency_us=args.latency_us, alpha_s=got.get("alpha_s"), round=rnd,
                                    family=family, size=args.size, steps=args.steps, micro_batch=1, **stamp.stamp())
                        found = got.get("rows") or [dict(row=f"{family}-launch", error=got.get("error"))]
                        for r in found:
                            lines.append(base | r)
                            shown = r.get("error") or f"{r['step_s']:.3f} s/step, " \
                                f"{max(r['link_tx'].values(), default=0) / 1e6:.2f} MB/step out of a node"
                            print(f"[n{nodes} {mbit} Mbit r{rnd}] {r['row']}: {shown}", file=sys.stderr, flush=True)
                        _append(args.out, lines[-len(found):])
            finally:
                cluster_down(directory)


def _append(path: Path, new: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        for line in new:
            f.write(json.dumps(line) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", default="2,4", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--mbit", default="1000,10000", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--latency-us", type=int, default=0,
                   help="netem delay a packet (needs sch_netem; 0: the veth links' own latency, measured)")
    p.add_argument("--per-node", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--size", default="2M")
    p.add_argument("--families", default="zerompi,torch,deepspeed", type=lambda s: s.split(","))
    p.add_argument("--rows", help="comma-separated: only these rows (cluster_worker.py names them)")
    p.add_argument("--out", type=Path, default=OUT, help="the jsonl (cluster.md is written beside it)")
    p.add_argument("--limit", type=float, default=900.0, help="seconds one launch may take")
    p.add_argument("--dir", default="/tmp/zerompi-bench-cluster", help="where the clusters live while they run")
    p.add_argument("--report-only", action="store_true", help="write cluster.md from cluster.jsonl, run nothing")
    args = p.parse_args()
    if not args.report_only:
        if os.geteuid() != 0:
            print("bench_cluster: needs root (jobs/cluster/up.sh: namespaces, tc, slurmd)", file=sys.stderr)
            raise SystemExit(3)
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the finally blocks take the cluster down
        run(args)
    print(cluster_report.write(args.out, args.out.with_suffix(".md")))


if __name__ == "__main__":
    main()
