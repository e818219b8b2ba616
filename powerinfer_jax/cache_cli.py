"""`python -m powerinfer_jax.cache {list,size,prune}`: what the cache holds and making room.

    python -m powerinfer_jax.cache size              # bytes per kind, and the cap
    python -m powerinfer_jax.cache list              # every entry, least recently used first
    python -m powerinfer_jax.cache prune             # evict down to the cap now
    python -m powerinfer_jax.cache prune --max-size 0 --dry-run   # what emptying would remove
    python -m powerinfer_jax.cache prune --kind sparsify --max-size 0   # the teacher's caches

Only what can be made again is removed (cache_limit.py says which kinds); downloaded models and
what a user made are listed, never removed. --json prints one JSON object for scripts.
"""
from __future__ import annotations

import argparse
import json

from powerinfer_jax import _cli, cache, cache_limit
from powerinfer_jax.errors import UserError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m powerinfer_jax.cache", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    for name, text in (("list", "every entry: kind, size, last use, how it goes"),
                       ("size", "bytes per kind, the evicted kinds' total and the cap"),
                       ("prune", "remove least recently used entries down to a size")):
        c = sub.add_parser(name, help=text, description=text)
        c.add_argument("--json", action=argparse.BooleanOptionalAction, default=False,
                       help="print one JSON object")
        if name == "prune":
            c.add_argument("--max-size", default=None, metavar="SIZE",
                           help="what the pruned kinds may still hold: 20G, 500M, 0 (default: "
                                f"the cap, ${cache_limit.LIMIT_ENV} or "
                                f"{cache_limit.DEFAULT_LIMIT >> 30}G)")
            c.add_argument("--kind", action="append", default=None,
                           choices=cache_limit.EVICTED + cache_limit.ON_REQUEST,
                           help="prune only this kind (repeatable; default: the kinds the cap "
                                f"evicts, {', '.join(cache_limit.EVICTED)})")
            c.add_argument("--dry-run", action=argparse.BooleanOptionalAction, default=False,
                           help="say what would be removed, remove nothing")
    return p


def _human(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    root = cache.cache_dir()
    cap = cache_limit.limit_bytes()
    if args.command == "prune":
        limit = cap if args.max_size is None else cache_limit.parse_size(args.max_size,
                                                                          "--max-size")
        if limit is None:
            raise UserError("--max-size: expected a size to prune down to, got no cap (set one "
                            "with --max-size or $POWERINFER_JAX_CACHE_LIMIT)")
        kinds = tuple(args.kind or cache_limit.EVICTED)
        gone = cache_limit.prune(limit, kinds=kinds, root=root, dry_run=args.dry_run)
        freed = sum(e.size for e in gone)
        if args.json:
            print(json.dumps({"root": str(root), "dry_run": args.dry_run, "kinds": list(kinds),
                              "max_bytes": limit, "freed_bytes": freed,
                              "removed": [e.describe(root) for e in gone]}))
            return
        verb = "would remove" if args.dry_run else "removed"
        for e in gone:
            print(f"{verb} {e.kind:12s} {_human(e.size):>10s}  {e.path}")
        print(f"{verb} {len(gone)} entries, {_human(freed)} ({', '.join(kinds)} down to "
              f"{_human(limit)})")
        return
    entries = sorted(cache_limit.scan(root), key=lambda e: e.last_used)
    if args.command == "list":
        rows = [e.describe(root) for e in entries]
        if args.json:
            print(json.dumps({"root": str(root), "entries": rows}))
            return
        for r in rows:
            print(f"{r['kind']:12s} {_human(r['bytes']):>10s}  {r['last_used']}  "
                  f"{r['path']}  [{r['removal']}]")
        print(f"{len(rows)} entries in {root}")
        return
    per_kind = {k: sum(e.size for e in entries if e.kind == k) for k in cache_limit.KINDS}
    evicted = sum(per_kind[k] for k in cache_limit.EVICTED)
    if args.json:
        print(json.dumps({"root": str(root), "bytes": per_kind, "total_bytes": sum(
            per_kind.values()), "evicted_kinds_bytes": evicted, "limit_bytes": cap}))
        return
    for k, n in per_kind.items():
        print(f"{k:12s} {_human(n):>10s}")
    print(f"{'total':12s} {_human(sum(per_kind.values())):>10s}  in {root}")
    print(f"cap on {', '.join(cache_limit.EVICTED)}: {_human(evicted)} of "
          f"{'no cap' if cap is None else _human(cap)} (${cache_limit.LIMIT_ENV})")


def run() -> None:
    """Entry point of `python -m powerinfer_jax.cache` (a user error: one line, status 2)."""
    _cli.run_main(main)
