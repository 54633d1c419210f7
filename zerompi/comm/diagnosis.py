"""From the ranks' records (recorder.py) to one hang report: who is where, who diverged, where first.

Pure: no MPI, no clock. The watchdog (live, on rank 0) and ``zerompi diagnose DIR`` (from the
files a dead job left) both call :func:`diagnose` and :func:`format_report`.

The culprit is found at the first event number where the ranks' events differ (a rank that has
not issued that event yet counts as one more kind of event, "not reached"):

0. ranks that raised an uncaught exception (guard.py asks for the report) are the culprits, alone and
   whatever else the records show (a rank that raised after its first record sends it again, watchdog.py);
1. ranks outside the largest group of agreeing ranks diverged (a strict majority decides);
2. on a tie (two ranks, or two equal camps), the ranks not waiting in a collective (in user code)
   are the culprits; failing that, the ranks whose event there differs from the one at the same
   position of their previous step (one extra micro-batch, a skipped module);
3. otherwise no present rank is named: every one of them may only be waiting on another, and the
   report must not blame a rank for waiting (each rank's state is listed for the reader);
4. ranks with no record (killed, or stuck where their watchdog thread cannot answer) are culprits
   whenever they are missing: alone if the present ranks agree on every event, else beside the above.

A missing rank is named with its host (the job's hosts, gathered when the watchdog started), and a
host none of whose ranks answered is named as unreachable: a lost node, or a cut link.

Where no rank could report (a lost node: the launcher tore the others down before any watchdog fired),
the watchers' end records (sentinel.py) are what is left: :func:`format_ends` names the ranks that died
alone, those torn down, and the hosts none of whose ranks left a record (lost with every process on them).

A watchdog blames only a wait that lasts while no rank moves (watchdog.py looks twice), so a slow
job whose ranks are merely spread over several events is not reported at all.
"""
from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path
from typing import Any, NamedTuple

from zerompi.comm.sentinel import ALONE, END_GLOB, TORN_DOWN

RECORD_GLOB = "rank-*.json"
REPORT_NAME = "report.txt"
NOT_REACHED = ("not reached",)
RAISED = "raised an exception"
DETAILED = 4      # culprits shown with their whole stack
STATE_FRAMES = 3  # innermost frames that, with its state, group a rank with others in "every rank"


class Divergence(NamedTuple):
    """The first event number where ranks differ, and which ranks issued what there."""

    index: int
    camps: dict[tuple, list[int]]  # event signature (or NOT_REACHED) -> ranks


class Report(NamedTuple):
    size: int
    records: dict[int, dict[str, Any]]  # rank -> record (recorder.Recorder.snapshot)
    missing: list[int]
    divergence: Divergence | None
    culprits: list[int]
    reason: str                         # why these ranks are the culprits
    hosts: tuple[str, ...] = ()         # rank -> host, where the job's hosts are known

    def host_of(self, ranks: list[int]) -> str:
        """`` on node2`` (or `` on node1, node2``) for ``ranks``, where their hosts are known."""
        if len(self.hosts) != self.size or not ranks:
            return ""
        return " on " + ", ".join(sorted({self.hosts[r] for r in ranks}))

    def unreachable(self) -> dict[str, list[int]]:
        """Hosts none of whose ranks answered (a lost node, a cut link) -> their ranks."""
        if len(self.hosts) != self.size or not self.records:
            return {}
        by_host: dict[str, list[int]] = defaultdict(list)
        for r, host in enumerate(self.hosts):
            by_host[host].append(r)
        return {h: rs for h, rs in sorted(by_host.items()) if not any(r in self.records for r in rs)}


def record_path(directory: str | os.PathLike, rank: int) -> Path:
    return Path(directory) / f"rank-{rank:05d}.json"


def write_record(directory: str | os.PathLike, record: dict[str, Any]) -> Path:
    """Write one rank's record atomically (a reader never sees half a file); OSError if it cannot."""
    os.makedirs(directory, exist_ok=True)
    path = record_path(directory, record["rank"])
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)
    return path


def _load(directory: str | os.PathLike, pattern: str) -> dict[int, dict[str, Any]]:
    """The JSON records matching ``pattern`` in ``directory``, by rank; unreadable files are skipped."""
    records: dict[int, dict[str, Any]] = {}
    for path in sorted(Path(directory).glob(pattern)):
        try:
            record = json.loads(path.read_text())
            records[int(record["rank"])] = record
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return records


def load_records(directory: str | os.PathLike) -> tuple[dict[int, dict[str, Any]], int]:
    """The records in ``directory`` and the job's size they name; unreadable files are skipped."""
    records = _load(directory, RECORD_GLOB)
    return records, max((int(r.get("size", 0)) for r in records.values()), default=0)


def load_ends(directory: str | os.PathLike) -> dict[int, dict[str, Any]]:
    """The watchers' end records in ``directory`` (sentinel.py), by rank; a record whose fields are not what a
    watcher writes (a rank and size that are whole numbers, hosts a list of names) is skipped."""
    return {r: e for r, e in _load(directory, END_GLOB).items() if _well_formed(e)}


def _well_formed(end: dict[str, Any]) -> bool:
    hosts, rank, size = end.get("hosts", []), end.get("rank"), end.get("size")
    return (isinstance(rank, int) and isinstance(size, int) and 0 <= rank < size and isinstance(end.get("ended"), str)
            and isinstance(hosts, list) and all(isinstance(h, str) for h in hosts))


class Ends(NamedTuple):
    """What the end records say: who died alone, who was torn down, who left nothing, and where."""

    size: int
    alone: list[int]
    torn_down: list[int]
    silent: list[int]                   # ranks with no end record
    lost: dict[str, list[int]]          # hosts none of whose ranks left a record -> their ranks
    hosts: tuple[str, ...]

    def settled(self) -> bool:
        """Whether the picture is whole: the hosts are known, some rank left a record, and every host has
        its ranks' records all or none (a host with some is still writing the rest)."""
        if len(self.hosts) != self.size or len(self.silent) == self.size:
            return False
        silent = set(self.silent)
        return all(not silent & set(rs) or set(rs) <= silent for rs in _by_host(self.hosts).values())


def _by_host(hosts: tuple[str, ...]) -> dict[str, list[int]]:
    by_host: dict[str, list[int]] = defaultdict(list)
    for r, host in enumerate(hosts):
        by_host[host].append(r)
    return dict(sorted(by_host.items()))


def read_ends(ends: dict[int, dict[str, Any]], size: int = 0) -> Ends:
    """Sort the end records of a job of ``size`` ranks (at least what the records name)."""
    size = max([size] + [int(e.get("size", 0)) for e in ends.values()])
    hosts = next((tuple(e["hosts"]) for _, e in sorted(ends.items()) if len(e.get("hosts", ())) == size), ())
    how = {r: e.get("ended") for r, e in ends.items()}
    silent = [r for r in range(size) if r not in ends]
    lost = {h: rs for h, rs in _by_host(hosts).items() if set(rs) <= set(silent) and len(silent) < size}
    return Ends(size, sorted(r for r, h in how.items() if h == ALONE),
                sorted(r for r, h in how.items() if h == TORN_DOWN), silent, lost, hosts)


def format_ends(ends: Ends, *, directory: str | None = None) -> str:
    """The end report: what ended the job where no rank could report a hang."""
    def on(ranks: list[int]) -> str:
        return " on " + ", ".join(sorted({ends.hosts[r] for r in ranks})) if len(ends.hosts) == ends.size else ""
    left = ends.size - len(ends.silent)
    lines = [f"zerompi end report: {ends.size} ranks, {left} left an end record (their watchers, sentinel.py)"]
    if ends.alone:
        lines.append(f"died alone: rank(s) {rank_list(ends.alone)}{on(ends.alone)} (killed by a signal or crashed "
                     "in native code, not by the launcher's teardown)")
    lines.extend(f"lost: {host} (rank(s) {rank_list(ranks)}): none of its ranks left a record, so every process "
                 "there ended at once, watchers included (a lost node)" for host, ranks in ends.lost.items())
    if ends.torn_down:
        lines.append(f"torn down by the launcher: rank(s) {rank_list(ends.torn_down)}{on(ends.torn_down)} (after "
                     "another rank ended)")
    others = [r for r in ends.silent if not any(r in rs for rs in ends.lost.values())]
    if others:
        lines.append(f"no record: rank(s) {rank_list(others)}{on(others)} (no watcher, or killed with it)")
    if directory:
        lines.append(f"records: {directory} (`zerompi diagnose {directory}` prints this report again)")
    return "\n".join(lines) + "\n"


def _signature(event: list) -> tuple:
    return (event[1], event[2], event[3], event[4])  # kind, group, what, bytes


def _by_index(record: dict[str, Any]) -> dict[int, list]:
    return {e[0]: e for e in record["events"]}


def find_divergence(records: dict[int, dict[str, Any]]) -> Divergence | None:
    """The first event number at which the present ranks' events differ, if any."""
    if len(records) < 2:
        return None
    rings = {r: _by_index(rec) for r, rec in records.items()}
    counts = {r: rec["count"] for r, rec in records.items()}
    first = max((min(ring) if ring else counts[r]) for r, ring in rings.items())  # all rings hold this on
    for i in range(first, max(counts.values())):
        camps: dict[tuple, list[int]] = defaultdict(list)
        for r in sorted(rings):
            camps[_signature(rings[r][i]) if i < counts[r] else NOT_REACHED].append(r)
        if len(camps) > 1:
            return Divergence(i, dict(camps))
    return None


def _off_pattern(record: dict[str, Any], index: int) -> bool:
    """True when the rank's event ``index`` differs from the event at the same position of its
    previous step, or lies past that step's end (False when it has no event there, or no
    previous step is in the ring)."""
    ring = _by_index(record)
    if index not in ring:
        return False
    step = ring[index][7]
    this = [e for e in record["events"] if e[7] == step]
    before = [e for e in record["events"] if e[7] == step - 1]
    pos = index - this[0][0]
    if not before:
        return False
    return pos >= len(before) or _signature(ring[index]) != _signature(before[pos])


def _culprits(records: dict[int, dict[str, Any]], missing: list[int],
              div: Divergence | None) -> tuple[list[int], str]:
    failed = sorted(r for r, rec in records.items() if rec.get("error"))
    if failed:
        return failed, RAISED
    if div is None:
        if missing:
            return missing, "every rank that answered is at the same collective; the missing ranks are not"
        return [], "every rank is at the same collective: no rank diverged (a slow collective or network)"
    sizes = sorted((len(r) for r in div.camps.values()), reverse=True)
    if sizes[0] > sizes[1]:
        major = max(div.camps.values(), key=len)
        return sorted(r for r in records if r not in major), f"the other {len(major)} rank(s) agree at this event"
    idle = sorted(r for r in records if records[r]["waiting"] is None)
    if idle and len(idle) < len(records):
        return idle, "not in a collective while the others wait in one"
    odd = sorted(r for r in records if _off_pattern(records[r], div.index))
    if odd and len(odd) < len(records):
        return odd, "its event here differs from the same point of its previous step"
    return [], "no majority: the ranks disagree and none stands out; none is named, since each may only wait on another"


def diagnose(records: dict[int, dict[str, Any]], size: int, hosts: tuple[str, ...] = ()) -> Report:
    """Compare the records of a job of ``size`` ranks (some may be missing); ``hosts``: each rank's host."""
    missing = [r for r in range(size) if r not in records]
    div = find_divergence(records)
    culprits, reason = _culprits(records, missing, div)
    if div is not None and missing and reason != RAISED:
        reason += "; ranks with no record are missing"
        culprits = sorted(set(culprits) | set(missing))
    return Report(size, records, missing, div, culprits, reason, tuple(hosts))


# ---- text -------------------------------------------------------------------------------------
def describe_event(event: list | tuple) -> str:
    """``all_gather@intra of 4096 B for bucket 3 (module 'mid')`` from an event or a signature."""
    kind, group, what, nbytes = event[-4:] if len(event) == 4 else _signature(event)
    return f"{kind}{'@' + group if group else ''} of {nbytes} B" + (f" for {what}" if what else "")


def where(record: dict[str, Any], *, timed: bool = True) -> str:
    """What the rank is doing: the collective it waits in (for how long, if ``timed``), its
    exception, or user code."""
    last = record["events"][-1] if record["events"] else None
    at = f"after event #{last[0]} ({describe_event(last)})" if last else "before its first collective"
    if record.get("error"):
        return f"raised {record['error']}, {at}, step {record['steps']}"
    if record["waiting"] is not None:
        event = record.get("waiting_event")
        return (f"waiting {record['waited']:.1f} s in " if timed else "waiting in ") + record["waiting"] + \
            ("" if event is None else f" [event #{event}]")
    return f"not in a collective: in user code, {at}, step {record['steps']}"


def rank_list(ranks: list[int]) -> str:
    """``0-5, 7, 9-10``: ranks in ascending runs."""
    runs: list[list[int]] = []
    for r in sorted(ranks):
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs) or "none"


def _camp_text(sig: tuple) -> str:
    return "not reached (has not issued it)" if sig == NOT_REACHED else describe_event(sig)


def _states(report: Report) -> dict[tuple, list[int]]:
    """Ranks grouped by what they do and the innermost frames of their stacks (missing ranks too)."""
    groups: dict[tuple, list[int]] = defaultdict(list)
    for r in range(report.size):
        rec = report.records.get(r)
        key = ("missing", ()) if rec is None else (where(rec, timed=False), tuple(rec["stack"][-STATE_FRAMES:]))
        groups[key].append(r)
    return groups


def format_report(report: Report, *, directory: str | None = None, trigger: str = "") -> str:
    lines = [f"zerompi hang report: {report.size} ranks, {len(report.records)} answered"
             + (f"; {trigger}" if trigger else "")]
    named = f"rank(s) {rank_list(report.culprits)}" if report.culprits else "none named"
    lines.append(f"culprit: {named} ({report.reason})")
    lines.extend(f"unreachable: {host} (rank(s) {rank_list(ranks)}): none of its ranks answered (a lost node, "
                 "or a cut link)" for host, ranks in report.unreachable().items())
    for r in report.culprits[:DETAILED]:
        rec = report.records.get(r)
        if rec is None:
            lines.append(f"  rank {r}: missing{report.host_of([r])} (no record: killed, or stuck where it cannot "
                         "answer)")
            continue
        lines.append(f"  rank {r}: {where(rec)}")
        lines.extend(f"    {frame}" for frame in rec["stack"])
    if len(report.culprits) > DETAILED:
        lines.append(f"  ... {len(report.culprits) - DETAILED} more culprit rank(s): see below")
    div = report.divergence
    if div is not None:
        lines.append(f"first divergence: event #{div.index}")
        lines.extend(f"  rank(s) {rank_list(rs)}: {_camp_text(sig)}" for sig, rs in div.camps.items())
    lines.append("every rank:")
    for (state, frames), ranks in sorted(_states(report).items(), key=lambda kv: kv[1][0]):
        rec = report.records.get(ranks[0]) if len(ranks) == 1 else None
        host = f" ({rec['host']} pid {rec['pid']})" if rec is not None else ""
        on = report.host_of(ranks) if state == "missing" else ""
        lines.append(f"  rank(s) {rank_list(ranks)}{host}: {state}{on}")
        lines.extend(f"    {frame}" for frame in frames)
    if directory:
        lines.append(f"records: {directory} (`zerompi diagnose {directory}` prints this report again)")
    return "\n".join(lines) + "\n"
