"""The pipeline planner's search over the IPU Model: units (:mod:`.units`), programs
with any subset of the planner's checkpoints (:mod:`.variants`), the per-IPU estimate
(:mod:`.problem`), candidates estimated as whole programs (:mod:`.candidate`) and the
branch and bound (:mod:`.search`). ``poptorch.plan`` (``poptorch/_plan``) captures
the model and calls it; nothing here imports ``poptorch``."""
