"""For tests/test_launch.py: fails like a gloo abort the first time (no flag file yet), succeeds the second."""

import sys
from pathlib import Path

from tests.launch import GLOO_ABORT

flag = Path(sys.argv[1])
if not flag.exists():
    flag.write_text("aborted once")
    print(GLOO_ABORT, file=sys.stderr)
    sys.exit(134)
print("second launch")
