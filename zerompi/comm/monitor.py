"""What every process group of one process shares, one concern per part.

A sub-group (``split``, ``split_shared``) counts into the same totals, numbers
its collectives in the same sequence, records them in the same ring, is
watched by the same watchdog and queues on the same communication thread as
its parent, so :class:`Monitor` is made once per process and handed to each
group.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from zerompi.comm.recorder import Event, Recorder
from zerompi.comm.thread import CommThread
from zerompi.comm.watchdog import Watchdog
from zerompi.errors import ZeroMPIError


class CollectiveMismatchError(ZeroMPIError):
    """Ranks called different collectives (rank-dependent control flow)."""


class Counters:
    """Bytes sent per collective kind, the way the ZeRO paper counts them; ``kind@label`` for labelled groups."""

    def __init__(self) -> None:
        self.bytes_sent: dict[str, int] = defaultdict(int)

    def add(self, kind: str, label: str, nbytes: int) -> None:
        self.bytes_sent[f"{kind}@{label}" if label else kind] += int(nbytes)


def compressed_kind(kind: str, codec: str) -> str:
    """The counter of a collective that carries ``codec``'s packed chunks (``all_gather.int8``): its bytes are
    what crosses, codes and scales, kept apart from the same collective's uncompressed bytes."""
    return f"{kind}.{codec}"


class Agreement:
    """Numbers this process's collectives; in debug mode the ranks compare descriptions before each one.

    A rank at another collective than its peers (rank-dependent control flow)
    would otherwise hang or, worse, exchange the wrong data silently.
    """

    def __init__(self, debug: bool = False) -> None:
        self.debug = debug
        self.seq = 0  # collectives issued so far

    def describe(self, kind: str, t: torch.Tensor, what: str) -> str:
        """The next collective's description (which takes the next sequence number)."""
        desc = f"{kind} #{self.seq} of {t.numel()} x {str(t.dtype).removeprefix('torch.')}" + \
               (f" for {what}" if what else "")
        self.seq += 1
        return desc

    @staticmethod
    def check(descs: list[str]) -> None:
        """Raise unless every rank's description (rank order) is the same."""
        if len(set(descs)) > 1:
            lines = "; ".join(f"rank {r}: {d}" for r, d in enumerate(descs))
            raise CollectiveMismatchError(f"ranks are at different collectives (rank-dependent control "
                                          f"flow, or a module skipped on some ranks): {lines}")


class Entered(NamedTuple):
    """A collective as issued: its description (for messages and the debug check) and its recorded event."""

    desc: str
    event: Event


@dataclass
class Monitor:
    """The parts shared by all groups of a process."""

    agreement: Agreement = field(default_factory=Agreement)
    counters: Counters = field(default_factory=Counters)
    watchdog: Watchdog = field(default_factory=Watchdog)
    recorder: Recorder = field(default_factory=Recorder)  # the ring of recent collectives (hang reports)
    comm_thread: CommThread | None = None  # mpi_progress="thread": every collective runs on it

    def enter(self, kind: str, t: torch.Tensor, what: str, label: str) -> Entered:
        """Number the next collective and append it to the recorder's ring."""
        desc = self.agreement.describe(kind, t, what)
        return Entered(desc, self.recorder.begin(kind, label, what, t.numel() * t.element_size()))
