"""docs/benchmarks.md, docs/benchmarks_more.md and CONTRIBUTING.md's scorecard show what the
committed JSON in benchmarks/results/ says: every generated block of those pages equals what
benchmarks/report.py renders from that JSON (tables only; no matplotlib), every block report.py
knows has its markers on exactly one page, every plot a page shows exists, and the results page
stays under 400 lines."""

from __future__ import annotations

import importlib.util
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _report():
    spec = importlib.util.spec_from_file_location("bench_report", os.path.join(ROOT, "benchmarks", "report.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def report():
    return _report()


@pytest.fixture(scope="module")
def pages(report):
    out = {}
    for path in report.PAGES:
        with open(path) as f:
            out[path] = f.read()
    return out


@pytest.fixture(scope="module")
def page(pages):
    return "".join(pages.values())


def test_page_tables_equal_what_report_generates_from_the_committed_json(report, pages):
    generated = report.render_blocks()
    assert report.rewrite_pages(pages, generated) == pages, "a page is out of date: run python benchmarks/report.py"
    on_pages = [name for text in pages.values() for name in report.page_blocks(text)]
    assert sorted(on_pages) == sorted(generated)


def test_results_page_is_short(report, pages):
    assert len(pages[report.PAGE].splitlines()) < 400


def test_every_source_the_page_uses_is_committed(report):
    absent = [name for name, _ in report.SOURCES.values()
              if not os.path.exists(os.path.join(report.RESULTS, name))]
    assert not absent, f"benchmarks/results/ lacks {absent}"


def test_every_plot_on_the_page_exists(report, page):
    images = re.findall(r"!\[[^\]]*\]\((images/[^)]+)\)", page)
    assert images, "the page shows no plots"
    missing = [p for p in images if not os.path.exists(os.path.join(ROOT, "docs", p))]
    assert not missing, f"plots missing from docs/: {missing} (python benchmarks/report.py writes them)"


def test_rewrite_replaces_only_the_blocks_and_refuses_unknown_markers(report):
    text = "intro\n<!-- report:a -->\nold\n<!-- /report:a -->\nprose\n"
    assert report.rewrite(text, {"a": "new\n"}) == "intro\n<!-- report:a -->\nnew\n<!-- /report:a -->\nprose\n"
    with pytest.raises(ValueError, match="does not know"):
        report.rewrite(text, {})
    with pytest.raises(ValueError, match="no page has the markers"):
        report.rewrite_pages({"p.md": text}, {"a": "x\n", "b": "y\n"})
    with pytest.raises(ValueError, match="several pages"):
        report.rewrite_pages({"p.md": text, "q.md": text}, {"a": "x\n"})


def test_a_missing_source_renders_as_the_command_that_records_it(report, monkeypatch, tmp_path):
    monkeypatch.setattr(report.data, "RESULTS", str(tmp_path))
    blocks = report.render_blocks()
    assert "python benchmarks/compare_fsdp2.py" in blocks["compare_step"]
    assert "Not recorded" in blocks["compare_step"]


def test_make_bench_record_records_every_source_the_pages_use(report):
    """``make bench-record`` (benchmarks/record_all.py) runs exactly the commands the pages name,
    the FSDP2 tuning first (the others read its winner), so one run records every figure."""
    spec = importlib.util.spec_from_file_location("record_all", os.path.join(ROOT, "benchmarks", "record_all.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    cmds = mod.commands()
    assert [k for k, _ in cmds][0] == "tuning"
    assert sorted(k for k, _ in cmds) == sorted(report.SOURCES)
    for key, argv in cmds:
        assert report.SOURCES[key][0] in " ".join(argv), key
