"""``poptorch.plan``'s implementation: the model's structure (:mod:`.structure`), the
planning capture (:mod:`.capture`), the ``plan()`` function (:mod:`.api`) and the
checks of its arguments (:mod:`.arguments`), the
:class:`~.result.Plan` and applying it (:mod:`.apply`), the command line
(:mod:`.cli`). The search itself is :mod:`popart_compiler.planner`."""
