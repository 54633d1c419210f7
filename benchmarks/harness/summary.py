"""Median and spread: of a list of repeats, of a timed row's repeats, and of the ratio of two rows.

``spread(values)`` is the summary every table cell of "median (min–max)" is made of.

A timed row runs ``--repeats`` times, interleaved (repeats.py), each repeat its own mpiexec job
recorded as its own ``row`` line in the jsonl. A repeat's step time
is the median over its timed steps of the slowest rank's step; a row's step time is the median
of its repeats' step times, and its spread the min-max of them.

A ratio of two rows is the ratio of their medians, with the range the two spreads allow
(fastest repeat of one over slowest of the other, and the reverse). A ratio whose range
contains 1.0 is "at parity": the rows differ by less than the run-to-run noise.
"""
from __future__ import annotations

import statistics
from collections import defaultdict

PARITY = "at parity"


def spread(values: list[float]) -> dict:
    """Median, min and max; ``samples`` in repeat order."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "samples": list(values)}


def fmt_spread(s: dict, fmt: str = "{:.2f}") -> str:
    """``median (min–max)``."""
    return f"{fmt.format(s['median'])} ({fmt.format(s['min'])}–{fmt.format(s['max'])})"


def fold(results: list[dict]) -> list[dict]:
    """One record per (size, np, row), in first-seen order, from the per-repeat records.

    A folded record keeps the fields of its first ok repeat and overrides: ``step_s_median`` (the
    median over repeats of the per-repeat median), ``step_s_lo`` / ``step_s_hi`` (their spread),
    ``step_s_repeats`` (per repeat), ``step_s_min`` / ``step_s_max`` (fastest and slowest single
    step of any repeat), ``repeats`` / ``repeats_ok``, the RSS maxima (median over repeats, with
    ``*_lo`` / ``*_hi``), and ``loss_final_spread`` (max-min of the final loss over repeats).
    """
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in results:
        groups[(r["size"], r["np"], r["row"])].append(r)
    folded = []
    for reps in groups.values():
        ok = [r for r in reps if r["status"] == "ok"]
        if not ok:
            folded.append(dict(reps[0], repeats=len(reps), repeats_ok=0))
            continue
        medians = [r["step_s_median"] for r in ok]
        out = dict(ok[0], repeats=len(reps), repeats_ok=len(ok), step_s_repeats=medians,
                   step_s_median=statistics.median(medians), step_s_lo=min(medians), step_s_hi=max(medians),
                   step_s_min=min(r["step_s_min"] for r in ok), step_s_max=max(r["step_s_max"] for r in ok),
                   loss_final_spread=max(r["loss_final"] for r in ok) - min(r["loss_final"] for r in ok),
                   loadavg_before_repeats=[r.get("loadavg_before") for r in reps])
        for key in ("rss_peak_max", "rss_steady_max"):
            vals = [r[key] for r in ok]
            out.update({key: statistics.median(vals), f"{key}_lo": min(vals), f"{key}_hi": max(vals)})
        if len(ok) < len(reps):
            out["failed_repeats"] = [dict(repeat=r.get("repeat"), status=r["status"], error=r.get("error", ""))
                                     for r in reps if r["status"] != "ok"]
        folded.append(out)
    return folded


def ratio(a: dict, b: dict, key: str = "step_s") -> dict:
    """``a`` over ``b`` for ``key`` (step_s, rss_peak_max, rss_steady_max): median, range, verdict.

    For step time the range is ``[a_lo / b_hi, a_hi / b_lo]`` over the repeats' spreads; a range
    containing 1.0 is "at parity", else "faster"/"slower" (for memory "smaller"/"larger").
    """
    mid_key = "step_s_median" if key == "step_s" else key
    med = a[mid_key] / b[mid_key]
    lo = a[f"{key}_lo"] / b[f"{key}_hi"]
    hi = a[f"{key}_hi"] / b[f"{key}_lo"]
    repeats = min(a.get("repeats_ok", 1), b.get("repeats_ok", 1))
    less, more = ("faster", "slower") if key == "step_s" else ("smaller", "larger")
    verdict = PARITY if lo <= 1.0 <= hi else (less if hi < 1.0 else more)
    return dict(median=med, lo=lo, hi=hi, verdict=verdict, repeats=repeats)


def fmt_ratio(r: dict, verdict: bool = True) -> str:
    """``0.97 (0.95-0.99, faster)``; with one repeat, no range can be given: ``0.97 (1 repeat)``."""
    if r["repeats"] < 2:
        return f"{r['median']:.2f} ({r['repeats']} repeat)"
    return f"{r['median']:.2f} ({r['lo']:.2f}-{r['hi']:.2f}" + (f", {r['verdict']})" if verdict else ")")


def target_verdict(r: dict, target: float) -> str:
    """Whether a ratio meets ``<= target``: by its whole range ("met"), by none of it ("MISSED"),
    or only by part of it ("within the spread")."""
    if r["repeats"] < 2:
        return "met (1 repeat)" if r["median"] <= target else "MISSED (1 repeat)"
    if r["hi"] <= target:
        return "met"
    if r["lo"] > target:
        return f"MISSED by {100 * (r['median'] / target - 1):.0f}%"
    return "within the spread (range straddles the target)"
