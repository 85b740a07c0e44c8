"""Optional test dependencies, imported so that a machine without them skips, with the reason,
instead of failing to collect the whole file.

``hypothesis`` is in the ``test`` extra, but a lent GPU machine runs the suite with whatever its
Python has: there, a missing ``hypothesis`` made every file that imported it at module level a
collection error, and those errors aborted the run with nothing tested. Files import
``given, settings, st, HealthCheck, Phase`` from here; without hypothesis each ``@given`` test is
skipped ("hypothesis is not installed") and the file's other tests still run.
"""

from __future__ import annotations

import functools

import pytest

try:
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import strategies as st

    HAVE_HYPOTHESIS = True
except ImportError:
    HAVE_HYPOTHESIS = False

    class _Inert:
        """Stands for strategies, settings and enum members at decoration time; never run."""

        def __getattr__(self, name: str) -> "_Inert":
            return self

        def __iter__(self):
            return iter(())

        def __call__(self, *args, **kwargs):
            if len(args) == 1 and callable(args[0]) and not kwargs and not isinstance(args[0], _Inert):
                return args[0] if _decorating_test(args[0]) else self  # settings(...)(test) / st.composite(fn)
            return self

    def _decorating_test(fn) -> bool:
        return getattr(fn, "__name__", "").startswith("test")

    st = HealthCheck = Phase = _Inert()
    settings = _Inert()

    def given(*args, **kwargs):
        def wrap(test):
            @functools.wraps(test)
            def skipped(*a, **k):
                pytest.skip("hypothesis is not installed")

            return pytest.mark.skip(reason="hypothesis is not installed")(skipped)

        return wrap

__all__ = ["HAVE_HYPOTHESIS", "HealthCheck", "Phase", "given", "settings", "st"]
