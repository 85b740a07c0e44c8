"""Record every figure of the results pages in one run: ``make bench-record``.

The pages (``docs/benchmarks.md``, ``docs/benchmarks_more.md``, ``CONTRIBUTING.md``'s scorecard)
are rendered from the JSON named in ``benchmarks/report.py``'s ``SOURCES``, each with the command
that records it. This runs exactly those commands -- the FSDP2 tuning first, since the others read
its winner as "FSDP2 tuned" -- so one invocation, at one commit on one machine, records what the
pages show, then renders them. Run it on a quiet machine at a clean commit (about two hours on two
cores); ``--only KEY,...`` records a subset, ``--dry-run`` lists the commands.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import shlex
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
log = logging.getLogger("record_all")


def _sources() -> dict:
    spec = importlib.util.spec_from_file_location("bench_report", os.path.join(HERE, "report.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.SOURCES


def commands(only: list[str] | None = None) -> list[tuple[str, list[str]]]:
    """``(key, argv)`` for every recorded source, the tuning first; ``python`` is this interpreter."""
    sources = _sources()
    keys = sorted(sources, key=lambda k: (k != "tuning", list(sources).index(k)))
    out = []
    for key in keys:
        if only and key not in only:
            continue
        argv = shlex.split(sources[key][1])
        if argv and argv[0] == "python":
            argv[0] = sys.executable
        out.append((key, argv))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default="", help="comma-separated SOURCES keys to record")
    p.add_argument("--dry-run", action="store_true", help="list the commands, run nothing")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    todo = commands([k for k in a.only.split(",") if k] or None)
    for key, cmd in todo:
        log.info("%s: %s", key, " ".join(cmd))
        if a.dry_run:
            continue
        t0 = time.monotonic()
        rc = subprocess.call(cmd, cwd=REPO)
        log.info("%s: exit %d after %.0f s", key, rc, time.monotonic() - t0)
        if rc:
            return rc
    if not a.dry_run:
        return subprocess.call([sys.executable, os.path.join(HERE, "report.py")], cwd=REPO)
    return 0


if __name__ == "__main__":
    sys.exit(main())
