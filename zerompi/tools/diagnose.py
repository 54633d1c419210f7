"""``zerompi diagnose DIR``: the hang report again, from the records a job left when it aborted.

Each rank writes ``rank-NNNNN.json`` into ``hang_dir`` when the watchdog diagnoses a hang (or an
uncaught exception asks for the report); this reads them and prints the report rank 0 printed,
naming ranks with no file as missing. The job's size comes from the records (``--size`` when every
file of the higher ranks is gone).
"""
from __future__ import annotations

import sys
from pathlib import Path

from zerompi.comm import diagnosis
from zerompi.errors import ZeroMPIError


def run(args) -> int:
    directory = Path(args.directory)
    if not directory.is_dir():
        raise ZeroMPIError(f"{directory} is not a directory (give the job's hang_dir)")
    records, size = diagnosis.load_records(directory)
    if not records:
        raise ZeroMPIError(f"no readable rank record ({diagnosis.RECORD_GLOB}) in {directory}: the job left none "
                           "there (hang_dir unset or not writable, or it did not abort on a hang)")
    size = max(size, args.size or 0)
    trigger = next((r["reason"] for _, r in sorted(records.items()) if r.get("reason")), "")
    hosts = next((tuple(r["hosts"]) for _, r in sorted(records.items()) if r.get("hosts")), ())
    sys.stdout.write(diagnosis.format_report(diagnosis.diagnose(records, size, hosts), trigger=trigger))
    return 0


def register(subparsers) -> None:
    """Add ``zerompi diagnose`` to the ``zerompi`` command's subparsers."""
    p = subparsers.add_parser("diagnose", help="print the hang report from the per-rank records a job left",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("directory", metavar="DIR", help="the job's hang_dir (holds rank-NNNNN.json)")
    p.add_argument("--size", type=int, default=None, metavar="N",
                   help="ranks in the job, if the records of the highest ranks are missing")
    p.set_defaults(func=run)
