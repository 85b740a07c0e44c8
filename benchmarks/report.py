"""Regenerate the figures of docs/benchmarks.md, docs/benchmarks_more.md and the goals scorecard in
CONTRIBUTING.md from the recorded runs in benchmarks/results/.

    python benchmarks/report.py            # rewrite the pages' generated blocks and the plots
    python benchmarks/report.py --check    # exit 1 if a page's blocks differ from the JSON (no plots)
    python benchmarks/report.py --no-plots # rewrite the blocks only (no matplotlib needed)

Each page keeps prose and figures apart: every table lies between ``<!-- report:NAME -->`` and
``<!-- /report:NAME -->`` and is rewritten from the JSON named in ``SOURCES``; the plots
(``docs/images/bench_*.png``, committed) are drawn from the same data. So a re-recorded JSON changes
the page by one command, and the page cannot say what the JSON does not (tests/project/test_report.py
checks the committed page against the committed JSON). Table code imports no matplotlib; the
plots need the ``bench`` extra (``pip install -e '.[bench]'``).

A source file that is missing renders as a one-line note naming the command that records it.

The blocks and plots live beside this file, by concept: ``_report_data`` (``SOURCES``, loading
the JSON, the cells' formats), ``_report_compare`` (docs/benchmarks.md's tables), ``_report_more``
(docs/benchmarks_more.md's), ``_report_goals`` (CONTRIBUTING.md's scorecard) and ``_report_plots``
(the matplotlib figures). This file maps each block's name to its function, rewrites the pages
and is the command line.
"""

from __future__ import annotations

import argparse
import difflib
import logging
import os
import re
import sys
from typing import Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _report_compare as compare
import _report_data as data  # noqa: F401  (load() reads data.RESULTS: patch it there)
import _report_goals as goals
import _report_more as more
from _report_data import REPO, RESULTS, SOURCES  # noqa: F401  (RESULTS, SOURCES: read by tests, record_all.py)
from _report_plots import plot_all

log = logging.getLogger("report")

PAGE = os.path.join(REPO, "docs", "benchmarks.md")
# Every page with generated blocks; each block appears on exactly one of them.
PAGES = (PAGE, os.path.join(REPO, "docs", "benchmarks_more.md"), os.path.join(REPO, "CONTRIBUTING.md"))

BLOCKS: dict[str, Callable[[], str]] = {
    "runs": compare.block_runs, "goals": goals.block_goals, "tuning": compare.block_tuning,
    "compare_step": compare.block_compare_step, "compare_memory": compare.block_compare_memory,
    "compare_wire": compare.block_compare_wire, "profile": compare.block_profile,
    "strategies": compare.block_strategies, "accum": compare.block_accum, "fp8": compare.block_fp8,
    "phases": compare.block_phases, "phases_host": more.block_phases_host,
    "allocators": more.block_allocators, "optimizer": more.block_optimizer, "native": more.block_native,
    "clip": more.block_clip, "estimate": more.block_estimate, "scale_memory": more.block_scale_memory,
    "scale_steps": more.block_scale_steps, "alpha_beta": more.block_alpha_beta, "shard_dim": more.block_shard_dim,
    "quantised": compare.block_quantised, "moe": compare.block_moe,
}

MARK = re.compile(r"(<!-- report:(\w+) -->\n)(.*?)(<!-- /report:\2 -->)", re.S)


def render_blocks() -> dict[str, str]:
    """Every generated block's Markdown, from the committed JSON (no matplotlib)."""
    return {name: fn().rstrip() + "\n" for name, fn in BLOCKS.items()}


def page_blocks(text: str) -> dict[str, str]:
    return {m.group(2): m.group(3) for m in MARK.finditer(text)}


def rewrite(text: str, blocks: dict[str, str], page: str = "the page") -> str:
    """``text`` with its generated blocks replaced; refuses markers report.py does not know."""
    unknown = set(page_blocks(text)) - set(blocks)
    if unknown:
        raise ValueError(f"{page} has report markers report.py does not know: {sorted(unknown)}")
    return MARK.sub(lambda m: m.group(1) + blocks[m.group(2)] + m.group(4), text)


def rewrite_pages(texts: dict[str, str], blocks: dict[str, str]) -> dict[str, str]:
    """Every page rewritten; every block must be on exactly one page."""
    where: dict[str, list[str]] = {}
    for path, text in texts.items():
        for name in page_blocks(text):
            where.setdefault(name, []).append(os.path.relpath(path, REPO))
    absent = set(blocks) - set(where)
    if absent:
        raise ValueError(f"no page has the markers of {sorted(absent)}: add "
                         "'<!-- report:NAME -->' / '<!-- /report:NAME -->' pairs where they go")
    twice = {name: pages for name, pages in where.items() if len(pages) > 1}
    if twice:
        raise ValueError(f"blocks on several pages: {twice}")
    return {path: rewrite(text, blocks, os.path.relpath(path, REPO)) for path, text in texts.items()}


# -- command line ------------------------------------------------------------------------------------
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="compare the page with the JSON; rewrite nothing")
    p.add_argument("--no-plots", action="store_true", help="rewrite the tables only")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    texts = {}
    for path in PAGES:
        with open(path) as f:
            texts[path] = f.read()
    new = rewrite_pages(texts, render_blocks())
    stale = [path for path in PAGES if new[path] != texts[path]]
    if args.check:
        for path in stale:
            sys.stdout.writelines(difflib.unified_diff(texts[path].splitlines(True), new[path].splitlines(True),
                                                       path, "generated"))
            log.error("%s is out of date: run python benchmarks/report.py", path)
        return 1 if stale else 0
    for path in stale:
        with open(path, "w") as f:
            f.write(new[path])
        log.info("rewrote %s", os.path.relpath(path, REPO))
    if not args.no_plots:
        for path in plot_all():
            log.info("wrote %s", os.path.relpath(path, REPO))
    return 0


if __name__ == "__main__":
    sys.exit(main())
