"""benchmarks/results/capacity.{json,md,png}: the file layout, merging and the report of bench_capacity.py.

Everything in the md is generated here from the json; nothing is added by hand. A results file holds
one measurement per mode (``measurements[mode]``: the commit and date it was taken at, the command,
the load average at its start and end) and the trials of all modes (``rows``), so a mode can be
re-measured and merged without re-running the others (``--modes M --merge``). A :class:`Study` says
what one ladder measures: full training of a GPT in gpt_report.py (``GPT``: capacity.*), LoRA on a
frozen Llama-style base in lora_report.py (``LORA``: lora_capacity.*).
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from bench_offload import traffic_limit_s
from harness import stamp
from harness.plots import pyplot, save

log = logging.getLogger("bench_capacity")
ROOT = Path(__file__).resolve().parents[1]
GiB = 1 << 30
SCHEMA = 2
SHARED_LOAD = 0.5  # a 1-minute load average at least this high before the first trial: other work ran
BEYOND = " and on past its end by its last step while a mode trains (since 22513c3: until disk or time stops it)"


@dataclass(frozen=True)
class Study:
    """One capacity ladder: its worker and modes, its model's settings, how its report reads."""

    key: str                                 # the results file's "study"
    stem: str                                # results/{stem}.json, .md, .png
    worker: str                              # the trial, under benchmarks/workers/
    modes: tuple[str, ...]
    ladder: tuple[int, ...]
    model: dict                              # the model's settings: kept in the results, --key value to the worker
    quick: dict                              # the same for --quick (a check of the harness)
    title: str
    describe: Callable[[dict], str]          # the md's paragraph on the model and settings
    readings: Callable[[dict], list[str]]    # the study's own computed paragraphs of the md
    x_label: str
    extra_sources: tuple[str, ...] = ()      # more files its trials run
    warm_up: tuple[str, ...] = ()            # modes started once outside the cap before their ladder

    @property
    def config(self) -> tuple[str, ...]:
        """What merged measurements must share."""
        return ("cap_gib", "ranks", *self.model, "max_rungs")

    def rungs(self, max_rungs: int) -> str:
        """The depths as a report names them (a whole ladder is climbed on past its end)."""
        return ", ".join(map(str, self.ladder[:max_rungs])) + (BEYOND if max_rungs >= len(self.ladder) else "")

    @property
    def sources(self) -> tuple[str, ...]:
        """The files a measurement depends on: uncommitted changes to them are recorded beside the commit."""
        return ("zerompi", "benchmarks/bench_capacity.py", "benchmarks/capacity_report.py",
                f"benchmarks/workers/{self.worker}", "tests/mpi/launcher.py", *self.extra_sources)


def git_state(paths: tuple[str, ...]) -> tuple[str, list[str]]:
    """HEAD's short hash and the files among ``paths`` with uncommitted changes."""
    return stamp.commit(short=True), stamp.dirty(paths)


def load(path: Path, study: Study) -> dict:
    """``study``'s results file, converted to the current layout if it is the first one (one run for all
    modes; only the GPT ladder was ever written in that layout)."""
    data = json.loads(path.read_text())
    if data.get("schema", 1) >= SCHEMA:
        return data
    measurements = {}
    for mode in study.modes:
        rows = [r for r in data["rows"] if r["mode"] == mode]
        if rows:  # that layout kept one commit and date (when written) for the run of all modes
            measurements[mode] = {
                "commit": data["commit"], "dirty": None, "date": data["date"], "command": data["command"],
                "machine": data["machine"], "cores": None, "nvme_dir": data["nvme_dir"],
                "commit_end": None, "seconds": sum(r["seconds"] for r in rows), "loadavg_before_run": None,
                "loadavg_start": None, "loadavg_end": None, "reading": None, "previous": None}
    return {"schema": SCHEMA, "written_by": None, **{k: data[k] for k in study.config},
            "measurements": measurements, "rows": data["rows"]}


def check_merge(study: Study, old: dict, new: dict) -> None:
    """Exits unless ``new`` (a results dict, or just its config) was measured the way ``old`` was."""
    differ = [k for k in study.config if old[k] != new[k]]
    if differ:
        raise SystemExit(f"cannot merge: {', '.join(f'{k} {new[k]} here, {old[k]} in the file' for k in differ)}")


def merge(study: Study, old: dict, new: dict) -> dict:
    """``old`` with the modes measured in ``new`` replaced by ``new``'s trials and measurements."""
    check_merge(study, old, new)
    modes, before = set(new["measurements"]), summary(study, old["rows"])
    merged = {**old, "measurements": dict(old["measurements"])}
    for mode in modes:
        m, prev, best = dict(new["measurements"][mode]), old["measurements"].get(mode), before.get(mode)
        if prev and best:
            m["previous"] = {"commit": prev["commit"], "date": prev["date"], "n_layer": best["n_layer"],
                             "params": best["params"], "cgroup_peak": best["cgroup_peak"]}
        merged["measurements"][mode] = m
    rows = [r for r in old["rows"] if r["mode"] not in modes] + new["rows"]
    merged["rows"] = sorted(rows, key=lambda r: study.modes.index(r["mode"]))  # stable: trial order kept per mode
    return merged


def summary(study: Study, rows: list[dict]) -> dict[str, dict]:
    """Per mode: its largest trial that trained, and what stopped the ladder above it."""
    best = {}
    for mode in study.modes:
        ok = [r for r in rows if r["mode"] == mode and r["ok"]]
        failed = sorted((r for r in rows if r["mode"] == mode and not r["ok"]), key=lambda r: r["n_layer"])
        if ok:
            top = max(ok, key=lambda r: r["params"])
            best[mode] = {"n_layer": top["n_layer"], "params": top["params"], "cgroup_peak": top["cgroup_peak"],
                          "step_s": top["step_s"][-1], "first_failure": failed[0]["n_layer"] if failed else None,
                          "why": failed[0]["why"] if failed else "ladder ended"}
    return best


def _gib(x: int | None) -> str:
    return f"{x / GiB:.2f}" if x else ""


def _load(m: dict) -> str:
    return "not recorded" if m.get("loadavg_start") is None else \
        f"{m['loadavg_start'][0]:.2f} → {m['loadavg_end'][0]:.2f} on {m['cores']} cores"


def _commit(m: dict) -> str:
    moved = m.get("commit_end") not in (None, m["commit"])
    return m["commit"] + (f" (HEAD at {m['commit_end']} by its end)" if moved else "") + (
        " + uncommitted changes" if m.get("dirty") else "")


def markdown(study: Study, data: dict) -> str:
    best, ms = data["best"], data["measurements"]
    base, w = best.get("stage0", {}).get("params"), data["written_by"]
    machines = sorted({m["machine"] for m in ms.values()})
    lines = [f"# {study.title}", "",
             f"Generated from `{study.stem}.json` by `benchmarks/bench_capacity.py` at commit {_commit(w)}, "
             f"{w['date']} (`{w['command']}`). Each mode's numbers come from the measurement listed for it "
             "below, at the commit named there.", "",
             f"Machine: {'; '.join(machines)}. Cap: {data['cap_gib']:g} GiB for the whole job ({data['ranks']} "
             f"ranks and mpiexec), a cgroup memory limit; no swap. {study.describe(data)}", "",
             "| mode | largest that trained | parameters | × stage 0 | job peak memory | s/step | next rung "
             "| measured at |", "|---|---|---|---|---|---|---|---|"]
    for mode in study.modes:
        b, m = best.get(mode), ms.get(mode)
        if m is None:
            continue
        if b is None:
            lines.append(f"| {mode} | none |  |  |  |  |  | {_commit(m)}, {m['date'][:10]} |")
            continue
        ratio = f"{b['params'] / base:.1f}×" if base else ""
        nxt = f"{b['first_failure']} layers: {b['why']}" if b["first_failure"] else b["why"]
        lines.append(f"| {mode} | {b['n_layer']} layers | {b['params'] / 1e6:.0f}M | {ratio} | "
                     f"{_gib(b['cgroup_peak'])} GiB | {b['step_s']:.1f} | {nxt} | {_commit(m)}, {m['date'][:10]} |")
    lines += _measurements(study, data)
    lines += _trials(data)
    lines += ["", "## Reading", "", "\n\n".join(study.readings(data) + common_readings(study, data)), ""]
    return "\n".join(lines)


def _measurements(study: Study, data: dict) -> list[str]:
    ms, w = data["measurements"], data["written_by"]
    lines = ["", "Measurements (load: the 1-minute load average when the mode's first trial started → after "
             "its last):", "", "| mode | commit | date | command | minutes | load |", "|---|---|---|---|---|---|"]
    for mode in study.modes:
        if (m := ms.get(mode)) is not None:
            lines.append(f"| {mode} | {_commit(m)} | {m['date']} | `{m['command']}` | {m['seconds'] / 60:.0f} | "
                         f"{_load(m)} |")
    for mode in study.modes:
        if (m := ms.get(mode)) and m.get("commit_end") not in (None, m["commit"]):
            lines.append(f"\n{mode}: HEAD moved during its measurement; `git diff --stat {m['commit']} "
                         f"{m['commit_end']} -- zerompi/` shows whether its later trials ran other library code.")
    for mode in study.modes:
        if ms.get(mode, {}).get("dirty"):
            lines.append(f"\n{mode} ran with uncommitted changes to: {', '.join(ms[mode]['dirty'])}.")
    if w.get("dirty"):
        lines.append(f"\nThis file was written with uncommitted changes to: {', '.join(w['dirty'])}.")
    return lines


def swap_traffic(row: dict, m: dict) -> tuple[float, float, float | None] | None:
    """A trained NVMe trial's swap bytes in its last step (read, written; both ranks) and the least seconds
    the disk needs for them at the raw O_DIRECT bandwidths this run probed before the mode's trials
    (bench_offload.traffic_limit_s: the larger of read and write time; None unmeasured)."""
    steps = [x.get("swap_bytes_per_step") for x in row["ranks"]]
    if not all(steps) or not any(sum(s[-1]) for s in steps):
        return None
    read, written = (sum(s[-1][i] for s in steps) for i in (0, 1))
    raw = m.get("raw_disk")
    return read, written, (traffic_limit_s(read, written, raw["read"], raw["write"]) if raw else None)


def traffic(row: dict, m: dict) -> str:
    """The trial table's cells: traffic | limit."""
    t = swap_traffic(row, m)
    if t is None:
        return " | "
    return f"{t[0] / GiB:.2f} / {t[1] / GiB:.2f} | " + (f"{t[2]:.1f}" if t[2] is not None else "no raw measurement")


def _trials(data: dict) -> list[str]:
    ms = data["measurements"]
    lines = ["", "Every trial (job peak: the cgroup's max usage, all processes of the job; load: the 1-minute "
             "load average when the trial started):", "",
             "| mode | layers | parameters | result | job peak GiB | peak RSS per rank GiB | s/step | trial s | load "
             "| swap GiB read/written per step, sum of ranks | traffic limit s (max of read, write time) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in data["rows"]:
        la = f"{r['loadavg']:.2f}" if r.get("loadavg") is not None else ""
        if r["ok"]:
            rss = "/".join(f"{x['peak_rss'] / GiB:.2f}" for x in r["ranks"])
            lines.append(f"| {r['mode']} | {r['n_layer']} | {r['params'] / 1e6:.0f}M | trained | "
                         f"{_gib(r['cgroup_peak'])} | {rss} | {r['step_s'][-1]:.1f} | {r['seconds']:.0f} | {la} | "
                         f"{traffic(r, ms.get(r['mode'], {}))} |")
        else:
            code = "" if r.get("exit") is None else f" (exit {r['exit']})"  # none: timed out or not run
            lines.append(f"| {r['mode']} | {r['n_layer']} |  | {r['why']}{code} | "
                         f"{_gib(r['cgroup_peak'])} |  |  | {r['seconds']:.0f} | {la} |  |  |")
    errors = [r for r in data["rows"] if not r["ok"] and r["why"] == "failed"]
    for r in errors:  # not the OOM killer: the job's own last words say why
        lines += ["", f"{r['mode']}, {r['n_layer']} layers, failed (exit {r['exit']}); the end of its output:", "",
                  "```", r["tail"].strip(), "```"]
    return lines


def nvme_slope(data: dict) -> tuple[float, float] | None:
    """How the job's peak grows across the stage3+nvme trials that trained: bytes per parameter, and
    the parameters at which that line reaches the cap; None with fewer than two such trials."""
    nvme = sorted((r for r in data["rows"] if r["mode"] == "stage3+nvme" and r["ok"] and r["cgroup_peak"]),
                  key=lambda r: r["params"])
    if len(nvme) < 2:
        return None
    a, b = nvme[0], nvme[-1]
    slope = (b["cgroup_peak"] - a["cgroup_peak"]) / (b["params"] - a["params"])
    return slope, (data["cap_gib"] * GiB - a["cgroup_peak"]) / slope + a["params"]


def common_readings(study: Study, data: dict) -> list[str]:
    """Paragraphs every ladder gets: commits, load, replaced measurements, then each ``--reading`` text."""
    best, ms, out = data["best"], data["measurements"], []
    commits = {m["commit"] for m in ms.values()}
    if len(commits) > 1:
        out.append(f"The modes were measured at {len(commits)} commits ({', '.join(sorted(commits))}): a ratio "
                   "between two modes compares the code at their two commits.")
    shared = [(mode, m) for mode, m in ms.items() if m.get("loadavg_before_run") and
              m["loadavg_before_run"][0] >= SHARED_LOAD]
    if shared:
        out.append("s/step was taken on a shared machine for " + "; ".join(
            f"{mode} (1-minute load average {m['loadavg_before_run'][0]:.2f} on {m['cores']} cores before the "
            "run's first trial)" for mode, m in shared) + ": other work ran beside the job, so those times are "
            "slower than on an idle machine. The cap counts the job's memory only, whatever else runs; but each "
            "depth is tried once, and a depth whose peak comes near the cap may train in one run and be OOM-killed "
            "in another, so the largest depth is good to about one rung.")
    unknown = [mode for mode, m in ms.items() if m.get("loadavg_start") is None]
    if unknown:
        out.append(f"The load was not recorded for {', '.join(unknown)}: whether other work shared the CPU, "
                   "and so slowed s/step, is unknown there.")
    for mode in study.modes:
        m, b = ms.get(mode), best.get(mode)
        if m and b and (p := m.get("previous")) and p["commit"] != m["commit"]:
            out.append(f"{mode} at {m['commit']}: {b['n_layer']} layers, {b['params'] / 1e6:.0f}M parameters "
                       f"(job peak {_gib(b['cgroup_peak'])} GiB); the measurement it replaced, at {p['commit']} "
                       f"({p['date'][:10]}), trained {p['n_layer']} layers, {p['params'] / 1e6:.0f}M "
                       f"(peak {_gib(p['cgroup_peak'])} GiB). `git log --oneline {p['commit']}..{m['commit']} -- "
                       "zerompi/` lists the library's changes in between.")
    notes: dict[str, list[str]] = {}
    for mode in study.modes:
        if ms.get(mode, {}).get("reading"):
            notes.setdefault(ms[mode]["reading"].strip(), []).append(f"{mode} at {ms[mode]['commit']}")
    out += [f"On {', '.join(where)}:\n\n{text}" for text, where in notes.items()]
    return out


def plot(study: Study, data: dict, path: Path) -> bool:
    if (plt := pyplot()) is None:
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    for mode in study.modes:
        ok = [r for r in data["rows"] if r["mode"] == mode and r["ok"]]
        if ok:
            m = data["measurements"][mode]
            ax.plot([r["params"] / 1e6 for r in ok], [r["cgroup_peak"] / GiB for r in ok], "o-",
                    label=f"{mode} ({m['commit']})")
    ax.axhline(data["cap_gib"], color="k", ls="--", lw=1, label=f"cap {data['cap_gib']:g} GiB")
    ax.set(xscale="log", xlabel=study.x_label, ylabel="job peak memory, GiB")
    ax.set_title(f"Capacity under a {data['cap_gib']:g} GiB cap, {data['ranks']} ranks")
    ax.legend()
    save(plt, fig, path, dpi=120, metadata={"Software": None})  # no matplotlib version: same data, same file
    return True


def write(study: Study, data: dict, out: Path, command: str) -> str:
    """{stem}.json, .md and .png under ``out``; the md's text. A png that cannot be redrawn is removed,
    not left showing older data."""
    commit, dirty = git_state(study.sources[1:3])  # the script's own files
    data = {**data, "written_by": {"commit": commit, "dirty": dirty, "command": command,
                                   "date": stamp.utc_now()}}
    data["best"] = summary(study, data["rows"])
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{study.stem}.json").write_text(json.dumps(data, indent=1) + "\n")
    md = markdown(study, data)
    (out / f"{study.stem}.md").write_text(md)
    png = out / f"{study.stem}.png"
    if not plot(study, data, png) and png.exists():
        png.unlink()
        log.warning("matplotlib is not installed: removed %s rather than leave it showing older data; "
                    "`--report-only` with matplotlib draws it from %s.json", png, study.stem)
    return md
