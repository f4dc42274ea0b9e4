"""``python -m poptorch.plan MODULE:FACTORY --ipus N``: see :mod:`poptorch._plan.cli`."""
import sys

from poptorch._plan.cli import main

sys.exit(main())
