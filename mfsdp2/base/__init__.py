"""The bottom layer: helpers every other folder may use, importing nothing of mfsdp2.

Owns what differs between the supported torch versions (``compat``), the epoch the step plans
are checked against (``plan_epoch``), named profiler ranges and the event log (``profiling``),
the sharding strategies and mesh topology as plain values (``strategy``), the walk over
nested inputs and outputs (``structures``) and the names of the attributes mfsdp2 sets on
objects it does not own (``markers``).

Why a folder of its own: these were once leaves of higher folders (``integrations``,
``runtime``, ``frontend``) that lower folders reached up into; keeping them at the bottom makes
every import between folders point down (``tests/project/test_layers.py`` checks it).
"""

MAY_IMPORT: tuple[str, ...] = ()
