"""``zerompi ckpt inspect PATH`` and ``zerompi ckpt consolidate PATH OUT``."""
from __future__ import annotations

import json
from pathlib import Path

from zerompi.errors import CheckpointError
from zerompi.checkpoint import paths, schema
from zerompi.checkpoint.consolidate import consolidate
from zerompi.checkpoint.index import CheckpointIndex
from zerompi.checkpoint.stores import store_named
from zerompi.checkpoint.durable import verify_file


_LAYOUTS = {"per_rank": "one file per rank", "shared": "one shared file", "per_node": "one file per node"}


def _tags(root: Path) -> list[str]:
    """Tags under ``root``; a tag leading outside the root through a symbolic link is refused."""
    return sorted(p.name for p in root.iterdir() if not p.name.startswith(".")
                  and paths.directory_in(root, p) and (p / schema.INDEX).exists())


def _verify(directory: Path, index: CheckpointIndex) -> str:
    try:
        verify_file(directory / schema.INDEX)
        store = store_named(index.layout, directory / schema.INDEX)
        store.verify(directory, index)
    except CheckpointError as e:
        return f"CORRUPT: {e}"
    except schema.H5_ERRORS as e:
        return f"CORRUPT: {schema.damaged(str(directory), e)}"
    return "ok (every checksum verified)"


def inspect(args) -> int:
    root = Path(args.path)
    if (root / schema.INDEX).exists():  # pointed at one tag's directory
        root, tags = root.parent, [root.name]
    elif root.is_dir():
        tags = _tags(root)
    else:
        raise CheckpointError(f"{root}: no such checkpoint directory")
    report, latest = [], schema.read_latest(root)
    for tag in tags:
        if not paths.directory_in(root, root / tag):
            raise CheckpointError(f"{root / tag}: missing")
        index = CheckpointIndex.read(root / tag / schema.INDEX)
        status = _verify(root / tag, index) if not args.no_verify else "not verified"
        report.append({"tag": tag, "latest": tag == latest, "steps": index.steps, "world_size": index.world_size,
                       "stage": index.stage, "dtype": index.dtype, "layout": index.layout, "checksums": status,
                       "frozen_saved": index.frozen_saved,
                       "tensors": [{"name": p["name"], "shape": p["shape"], "trainable": p["trainable"],
                                    "bytes_fp32": 4 * _numel(p["shape"])} for p in index.params]})
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    for r in report:
        total = sum(t["bytes_fp32"] for t in r["tensors"])
        print(f"{r['tag']}{' (latest)' if r['latest'] else ''}: step {r['steps']}, world size {r['world_size']}, "
              f"stage {r['stage']}, {r['dtype']}, {_LAYOUTS[r['layout']]}, {len(r['tensors'])} tensors, {total / 2**20:.1f} MiB fp32, "
              f"checksums {r['checksums']}{'' if r['frozen_saved'] else '; frozen parameters not saved'}")
        if args.tensors:
            for t in r["tensors"]:
                print(f"  {t['name']:50s} {str(tuple(t['shape'])):20s} {t['bytes_fp32']:>12d} B"
                      f"{'' if t['trainable'] else '  (frozen)' if r['frozen_saved'] else '  (frozen, not saved)'}")
    return 0 if all(r["checksums"].startswith(("ok", "not")) for r in report) else 1


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def run_consolidate(args) -> int:
    out = consolidate(args.path, args.out, args.tag)
    print(f"wrote {out}")
    return 0


def register(subparsers) -> None:
    ckpt = subparsers.add_parser("ckpt", help="inspect or consolidate a checkpoint")
    sub = ckpt.add_subparsers(dest="ckpt_command", required=True)
    p = sub.add_parser("inspect", help="tags, step, world size, stage, dtype, tensors, checksum status")
    p.add_argument("path", help="checkpoint root (or one tag's directory)")
    p.add_argument("--tensors", action="store_true", help="list every tensor")
    p.add_argument("--json", action="store_true")
    p.add_argument("--no-verify", action="store_true", help="skip reading every byte to check checksums")
    p.set_defaults(func=inspect)
    c = sub.add_parser("consolidate", help="write full fp32 parameters to one .h5 or .safetensors file")
    c.add_argument("path", help="checkpoint root")
    c.add_argument("out", help="output file, .h5 or .safetensors")
    c.add_argument("--tag", default=None, help="tag to read (default: latest)")
    c.set_defaults(func=run_consolidate)
