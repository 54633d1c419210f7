"""``zerompi diagnose [DIR]``: the hang report again, from the records a job left when it aborted.

Each rank writes ``rank-NNNNN.json`` into ``hang_dir`` when the watchdog diagnoses a hang (or an
uncaught exception asks for the report); this reads them and prints the report rank 0 printed,
naming ranks with no file as missing. The job's size comes from the records (``--size`` when every
file of the higher ranks is gone).

Where there are none, the job ended before any watchdog could report (a rank killed, a lost node): the
ranks' watchers left ``end-NNNNN.json`` files instead (comm/sentinel.py), and this prints the end report,
which names the ranks that died alone, those torn down and the hosts that left nothing. Right after the launcher returns,
``--wait S`` waits up to S seconds for the picture to settle (every host's records all there, or none).

Without DIR, inside a batch job, it reads where the job's ranks wrote with no ``hang_dir`` set: the temporary
directory named after the job (watchdog.py's ``default_directory``; the ranks' ``TMPDIR`` must be this
process's). ``--if-unreported`` prints nothing where the hang report was printed (the reporting rank writes
``report.txt`` beside the records after printing it); where ranks left records but no rank lived to print the
report, it prints it (a batch script runs it after every failed run, jobs/slurm/train.sbatch).
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

from zerompi.comm import diagnosis, watchdog
from zerompi.errors import ZeroMPIError

POLL = 0.2  # seconds between looks while --wait lasts


def run(args) -> int:
    directory = Path(args.directory if args.directory is not None else _job_directory())
    deadline = time.monotonic() + args.wait
    while True:
        records, size = diagnosis.load_records(directory) if directory.is_dir() else ({}, 0)
        ends = diagnosis.read_ends(diagnosis.load_ends(directory) if directory.is_dir() else {}, args.size or 0)
        if records or ends.settled() or time.monotonic() >= deadline:
            break
        time.sleep(POLL)
    if records and args.if_unreported and (directory / diagnosis.REPORT_NAME).exists():
        return 0  # the reporting rank printed this report, then wrote it there
    if records:
        size = max(size, args.size or 0)
        trigger = next((r["reason"] for _, r in sorted(records.items()) if r.get("reason")), "")
        hosts = next((tuple(r["hosts"]) for _, r in sorted(records.items()) if r.get("hosts")), ())
        sys.stdout.write(diagnosis.format_report(diagnosis.diagnose(records, size, hosts), trigger=trigger))
        return 0
    if len(ends.silent) < ends.size:
        sys.stdout.write(diagnosis.format_ends(ends))
        return 0
    if not directory.is_dir():
        raise ZeroMPIError(f"{directory} is not a directory (give the job's hang_dir)")
    raise ZeroMPIError(f"no readable rank record ({diagnosis.RECORD_GLOB}) nor end record ({diagnosis.END_GLOB}) in "
                       f"{directory}: the job left none there (hang_dir unset or not writable, or it ended cleanly)")


def _job_directory() -> str:
    job = watchdog.batch_job()
    if job is None:
        raise ZeroMPIError(f"give DIR, the job's hang_dir: outside a batch job ({', '.join(watchdog.JOB_VARIABLES)} "
                           "unset) there is no default directory to read")
    return watchdog.default_directory(job)


def register(subparsers) -> None:
    """Add ``zerompi diagnose`` to the ``zerompi`` command's subparsers."""
    p = subparsers.add_parser("diagnose", help="print the hang or end report from the per-rank records a job left",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("directory", metavar="DIR", nargs="?", default=None,
                   help="the job's hang_dir (holds rank-NNNNN.json); default: inside a batch job, the directory its "
                        "ranks write to when hang_dir is not set")
    p.add_argument("--if-unreported", action="store_true",
                   help="print nothing where the hang report was printed already (report.txt beside the records)")
    p.add_argument("--size", type=int, default=None, metavar="N",
                   help="ranks in the job, if the records of the highest ranks are missing")
    p.add_argument("--wait", type=float, default=0.0, metavar="S",
                   help="seconds to wait for the records to settle (right after the launcher returned)")
    p.set_defaults(func=run)
