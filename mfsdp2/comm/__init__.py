"""Collectives: every collective mfsdp2 issues, and how.

Owns the communicator (``communicator``: the one place that issues collectives, with its
streams, async handles, timeouts and checks), the backend of each device type (``devices``) and
the custom collectives of ``set_custom_all_gather`` / ``set_custom_reduce_scatter`` (``custom``).
What is reduced and when (a group's gradient reduction, buckets) is ``groups``'s, which uses
this folder. This package re-exports nothing: import from its modules.
"""

MAY_IMPORT: tuple[str, ...] = ("base",)
