"""``python -m opsd.dashboards write|check DIR``: the dashboards' JSON files from the code."""

import sys

from opsd.dashboards.build import main

sys.exit(main())
