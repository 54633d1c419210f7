"""The DeepSpeedExamples config corpus, read by zerompi's translation and by DeepSpeed's own parser.

    python benchmarks/ds_config_corpus.py [--snapshot GIT_DIR] [--rev HEAD]

GIT_DIR is a (bare) clone of DeepSpeedExamples, read with git and never checked out or run, except
DeepSpeed-Chat's and DeepSpeed-VisualChat's ``ds_utils.py``, whose dict-building functions are
called (BUILDERS). A config comes from one of: a JSON file whose top-level keys are DeepSpeed's;
a dict literal in a .py file (ds_config_python.py); a shell heredoc or sed-filled template with the
script's defaults (ds_config_shell.py); a builder call. Each is classified by
``zerompi.compat.deepspeed.config_from`` (once more with ``total_steps`` when the error asks for it)
and by DeepSpeed's ``DeepSpeedConfig(dict)``, whose process group is stood in for (rank 0 of the
world size the config's own batch keys imply, else 1) so that a plain config parses on the CPU.
Results: benchmarks/results/ds_config_corpus.{jsonl,md}.
"""
from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import re
import subprocess
import sys
import warnings
from collections import Counter
from pathlib import Path
from unittest import mock

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]
from ds_config_python import call_builder, default_namespace, read_python  # noqa: E402
from ds_config_shell import read_script  # noqa: E402
from harness.stamp import commit, dirty, version  # noqa: E402

SNAPSHOT = "/work/.mirror/deepspeedai+DeepSpeedExamples/repo"
RESULTS = HERE / "results"
TOTAL_STEPS = 1000  # what a script would pass for a scheduler's "auto" total_num_steps
_JSON_KEYS = {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
              "zero_optimization", "fp16", "bf16", "optimizer", "scheduler", "gradient_clipping"}
_BATCH = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
_CHAT = "applications/DeepSpeed-Chat/"
_VCHAT = "applications/DeepSpeed-VisualChat/"
# (module, function, caller whose argparse defaults fill offload/dtype/args, extra kwargs): each at stages 0-3.
BUILDERS = (
    (_CHAT + "dschat/utils/ds_utils.py", "get_train_ds_config",
     _CHAT + "training/step1_supervised_finetuning/main.py", {}),
    (_CHAT + "dschat/utils/ds_utils.py", "get_train_ds_config",  # step 3's actor as its scripts run it
     _CHAT + "training/step3_rlhf_finetuning/main.py", {"enable_hybrid_engine": True}),
    (_CHAT + "dschat/utils/ds_utils.py", "get_eval_ds_config",
     _CHAT + "training/step3_rlhf_finetuning/main.py", {}),
    (_VCHAT + "utils/ds_utils.py", "get_train_ds_config", _VCHAT + "training/main.py", {}),
)


class Snapshot:
    """The text files of one commit of a git directory, read in one ``git cat-file --batch``."""

    def __init__(self, git_dir: str, rev: str):
        self.git_dir = git_dir
        self.commit = self._git("rev-parse", rev).strip()
        listing = self._git("ls-tree", "-r", self.commit).splitlines()
        blobs = {}
        for line in listing:
            meta, path = line.split("\t", 1)
            if meta.split()[1] == "blob" and path.endswith((".json", ".py", ".sh", ".template")):
                blobs[path] = meta.split()[2]
        self.texts = self._cat(blobs)

    def _git(self, *args: str, stdin: bytes | None = None) -> str | bytes:
        out = subprocess.run(["git", "--git-dir", self.git_dir, *args], input=stdin, capture_output=True,
                             check=True).stdout
        return out if stdin is not None else out.decode()

    def _cat(self, blobs: dict[str, str]) -> dict[str, str | None]:
        data = self._git("cat-file", "--batch", stdin="".join(f"{b}\n" for b in blobs.values()).encode())
        texts, pos = {}, 0
        for path in blobs:  # the answers come in the order asked
            end = data.index(b"\n", pos)
            header = data[pos:end].split()
            if header[-1] == b"missing":  # a partial clone's absent (large) blob
                texts[path], pos = None, end + 1
                continue
            size = int(header[2])
            texts[path] = data[end + 1:end + 1 + size].decode("utf-8", "replace")
            pos = end + 1 + size + 1
        return texts

    def read(self, path: str) -> str | None:
        return self.texts.get(path)


def _entry(source: str, line: int | None, how: str, config: dict | None, missing: str = "") -> dict:
    return {"source": source + (f":{line}" if line else ""), "extraction": how, "config": config,
            "not_extracted": missing or None}


def collect(snap: Snapshot) -> list[dict]:
    """Every config of the snapshot (and every candidate that could not be filled, config None)."""
    out, filled = [], set()
    builder_modules = {b[0] for b in BUILDERS}
    for path, text in sorted(snap.texts.items()):
        if text is None:
            continue
        if path.endswith(".sh"):
            for f in read_script(text, path, snap.read):
                filled.update(w for w in f.how.replace(",", " ").split() if w.endswith(".json"))
                config = _json(f.text)
                why = f.missing or ("" if config else "the filled text is not JSON (a value left empty)")
                out.append(_entry(path, f.line, f.how, config, why))
        elif path.endswith(".py") and path not in builder_modules:
            out += [_entry(path, f.line, f.how, f.config, f.missing) for f in read_python(text)]
    for path, text in sorted(snap.texts.items()):
        if path.endswith(".json") and text is not None:
            doc = _json(text)
            if isinstance(doc, dict) and _JSON_KEYS & set(doc):
                out.append(_entry(path, None, "json file", doc))
            elif doc is None and "temp" in path.lower() and path not in filled:
                out.append(_entry(path, None, "template", None, "no script fills it with its defaults"))
        elif path.endswith(".template") and "ds_config" in path:
            out.append(_entry(path, None, "template", None, "filled by a generator program, not by defaults"))
    # a script another one runs is read with that one's arguments; read alone it lacks them
    called = {w.split(":")[0] for e in out for w in e["extraction"].split() if ".sh:" in w}
    out = [e for e in out if e["config"] is not None or e["source"].split(":")[0] not in called]
    return out + _builders(snap)


def _json(text: str | None) -> dict | None:
    try:
        doc = json.loads(text) if text else None
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None


def _builders(snap: Snapshot) -> list[dict]:
    """The builders called as their callers call them with default arguments, at each ZeRO stage."""
    out = []
    for module, func, caller, extra in BUILDERS:
        defaults = default_namespace(snap.read(caller))
        takes_args = module.startswith(_VCHAT)  # VisualChat's builder reads the parsed arguments itself
        kwargs = {"offload": False} if takes_args else {"offload": defaults.offload, "dtype": defaults.dtype}
        for stage in range(4):
            args = {**kwargs, **extra, "stage": stage}
            config = call_builder(snap.read(module), module, func, *((defaults,) if takes_args else ()), **args)
            shown = ("args, " if takes_args else "") + ", ".join(f"{k}={v!r}" for k, v in args.items())
            out.append(_entry(module, None, f"builder {func}({shown}), defaults of {caller}", config))
    return out


def zerompi_verdict(config: dict) -> dict:
    """config_from's verdict; a refusal that asks for total_steps is tried once more with it."""
    from zerompi.compat.deepspeed import config_from
    from zerompi.errors import ConfigError
    out = {}
    for label, overrides in (("zerompi", {}), ("zerompi_total_steps", {"total_steps": TOTAL_STEPS})):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the no-effect warning is not a verdict
            try:
                config_from(copy.deepcopy(config), **overrides)
                out[label] = {"accepted": True, "reason": None}
            except (ConfigError, TypeError, ValueError) as e:
                out[label] = {"accepted": False, "reason": f"{e}" if isinstance(e, ConfigError)
                              else f"{type(e).__name__}: {e}"}
        if out["zerompi"]["accepted"] or "total_steps" not in (out["zerompi"]["reason"] or ""):
            break
    return out


def implied_world_size(config: dict) -> int:
    """The data-parallel size the batch keys imply when all three are given (else 1)."""
    t, m, g = (config.get(k) for k in _BATCH)
    if all(type(v) is int and v > 0 for v in (t, m, g)) and t % (m * g) == 0:
        return t // (m * g)
    return 1


def deepspeed_verdict(config: dict) -> dict:
    """DeepSpeedConfig's verdict, with rank 0 of the implied world size standing in for a process group."""
    import deepspeed.comm as dist
    from deepspeed.runtime.config import DeepSpeedConfig
    world = implied_world_size(config)
    with mock.patch.object(dist, "get_rank", lambda *a, **k: 0), \
            mock.patch.object(dist, "get_world_size", lambda *a, **k: world):
        try:
            DeepSpeedConfig(copy.deepcopy(config))
            return {"accepted": True, "reason": None, "world_size": world}
        except Exception as e:  # noqa: BLE001  (any refusal is the verdict)
            text = str(e).strip().splitlines()[0] if str(e).strip() else ""
            if any(config.get(k) == "auto" for k in _BATCH):  # DeepSpeed compares it with numbers
                text = f"a batch size \"auto\" ({text}); the Hugging Face Trainer fills it before DeepSpeed reads it"
            return {"accepted": False, "reason": f"{type(e).__name__}: {text}"[:300], "world_size": world}


def zerompi_reasons(message: str) -> list[str]:
    """One label per refused feature, unsupported key or invalid value of a ConfigError."""
    if "total_steps" in message:
        return ["scheduler total_num_steps \"auto\" (accepted once total_steps is given)"]
    features, _, keys = message.partition("unsupported DeepSpeed config keys: ")
    out = [label for _, label in re.findall(r"(\S+) \(([^():]+): ", features)
           if "does not implement" in features]
    out += [f"unsupported key {k}" for k in keys.split(", ") if k]
    if not out:
        head = re.match(r"[\w.]+", message)
        out = [f"{head.group(0) if head else message[:60]}: invalid value"]
    return out


def deepspeed_reason(message: str) -> str:
    if "Hugging Face Trainer" in message:
        return "a batch size \"auto\" (compared with 0: TypeError); the Hugging Face Trainer fills it first"
    return re.sub(r"\d+", "N", message)[:110]


def classify(entries: list[dict]) -> None:
    for e in entries:
        if e["config"] is not None:
            e.update(zerompi_verdict(e["config"]))
            e["deepspeed"] = deepspeed_verdict(e["config"])


def tally(entries: list[dict]) -> dict:
    """The four groups, and the reasons inside the two one-sided ones (a config counts under each of its reasons)."""
    done = [e for e in entries if e["config"] is not None]
    groups = {"both": [], "neither": [], "zerompi_refuses": [], "deepspeed_refuses": []}
    for e in done:
        z, d = e["zerompi"]["accepted"], e["deepspeed"]["accepted"]
        groups["both" if z and d else "neither" if not z and not d else
               "zerompi_refuses" if d else "deepspeed_refuses"].append(e)
    return {
        "total": len(done), "not_extracted": [e for e in entries if e["config"] is None],
        "groups": groups,
        "total_steps_rescued": sum(1 for e in done if not e["zerompi"]["accepted"]
                                   and e.get("zerompi_total_steps", {}).get("accepted")),
        "zerompi_reasons": Counter(r for e in groups["zerompi_refuses"]
                                   for r in dict.fromkeys(zerompi_reasons(e["zerompi"]["reason"]))),
        "neither_reasons": Counter(r for e in groups["neither"]
                                   for r in dict.fromkeys(zerompi_reasons(e["zerompi"]["reason"]))),
        "deepspeed_reasons": Counter(deepspeed_reason(e["deepspeed"]["reason"])
                                     for e in groups["deepspeed_refuses"] + groups["neither"]),
        "kinds": Counter(e["extraction"].split(" ")[0].split(",")[0] for e in done),
    }


def stamp(snap: Snapshot) -> dict:
    return {"deepspeedexamples_commit": snap.commit, "zerompi_commit": commit(),
            "zerompi_uncommitted": dirty(("zerompi",)),
            "deepspeed": version("deepspeed"), "torch": version("torch"), "python": sys.version.split()[0],
            "total_steps": TOTAL_STEPS}


def write_jsonl(path: Path, meta: dict, entries: list[dict]) -> None:
    with path.open("w") as f:
        f.write(json.dumps({"meta": meta}) + "\n")
        for e in entries:
            row = {k: e.get(k) for k in ("source", "extraction", "not_extracted", "zerompi", "zerompi_total_steps",
                                         "deepspeed")}
            f.write(json.dumps({k: v for k, v in row.items() if v is not None}) + "\n")


def _rows(counter: Counter) -> list[str]:
    return [f"| {reason} | {n} |" for reason, n in sorted(counter.items(), key=lambda kv: (-kv[1], kv[0]))]


def write_md(path: Path, meta: dict, t: dict) -> None:
    g = t["groups"]
    z_ok = len(g["both"]) + len(g["deepspeed_refuses"])
    dirty_note = f" (uncommitted: {', '.join(meta['zerompi_uncommitted'])})" if meta["zerompi_uncommitted"] else ""
    lines = [
        "# DeepSpeedExamples configs: zerompi's `config_from` and DeepSpeed's `DeepSpeedConfig`", "",
        (f"DeepSpeedExamples {meta['deepspeedexamples_commit']}, zerompi {meta['zerompi_commit']}{dirty_note}, "
         f"DeepSpeed {meta['deepspeed']}, torch {meta['torch']}, Python {meta['python']}. "
         "`python benchmarks/ds_config_corpus.py`; one line per config in `ds_config_corpus.jsonl`. "
         "DeepSpeedConfig ran without a process group, rank 0 of the world size the config's three batch keys "
         "imply (else 1)."), "",
        (f"{t['total']} configs ({', '.join(f'{k} {n}' for k, n in t['kinds'].most_common())}); "
         f"zerompi accepts {z_ok} ({z_ok + t['total_steps_rescued']} with `total_steps={TOTAL_STEPS}`), "
         f"DeepSpeed {len(g['both']) + len(g['zerompi_refuses'])}."), "",
        "| group | configs |", "|---|---|",
        f"| accepted by both | {len(g['both'])} |", f"| refused by both | {len(g['neither'])} |",
        f"| refused by zerompi alone | {len(g['zerompi_refuses'])} |",
        f"| refused by DeepSpeed alone | {len(g['deepspeed_refuses'])} |", "",
        "Refused by zerompi alone, by reason (a config refused for two reasons counts under both):", "",
        "| reason | configs |", "|---|---|", *_rows(t["zerompi_reasons"]), "",
        "Refused by both: zerompi's reasons", "", "| reason | configs |", "|---|---|", *_rows(t["neither_reasons"]),
        "", "Refused by DeepSpeed (alone or with zerompi), by its message:", "",
        "| DeepSpeed's message (numbers as N) | configs |", "|---|---|", *_rows(t["deepspeed_reasons"]), "",
        f"Not extracted ({len(t['not_extracted'])}): a value the source does not give by default.", "",
        "| source | kind | why |", "|---|---|---|",
        *[f"| {e['source']} | {e['extraction']} | {e['not_extracted']} |" for e in t["not_extracted"]],
    ]
    path.write_text("\n".join(lines) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--snapshot", default=SNAPSHOT, help="git directory of DeepSpeedExamples")
    p.add_argument("--rev", default="HEAD")
    p.add_argument("--out", type=Path, default=RESULTS)
    a = p.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    logging.disable(logging.WARNING)  # DeepSpeed's per-config info lines
    snap = Snapshot(a.snapshot, a.rev)
    entries = collect(snap)
    classify(entries)
    meta, t = stamp(snap), tally(entries)
    a.out.mkdir(parents=True, exist_ok=True)
    write_jsonl(a.out / "ds_config_corpus.jsonl", meta, entries)
    write_md(a.out / "ds_config_corpus.md", meta, t)
    g = t["groups"]
    print(f"{t['total']} configs: both {len(g['both'])}, neither {len(g['neither'])}, zerompi refuses "
          f"{len(g['zerompi_refuses'])}, DeepSpeed refuses {len(g['deepspeed_refuses'])}; "
          f"not extracted {len(t['not_extracted'])}")


if __name__ == "__main__":
    main()
