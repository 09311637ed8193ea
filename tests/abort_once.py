"""For tests/test_launch.py: fails like a gloo abort the first N times (argv[2], default 1; the count is kept in the
file argv[1]), then succeeds."""

import sys
from pathlib import Path

from tests.launch import GLOO_ABORT

flag = Path(sys.argv[1])
times = int(sys.argv[2]) if len(sys.argv) > 2 else 1
aborted = int(flag.read_text()) if flag.exists() else 0
if aborted < times:
    flag.write_text(str(aborted + 1))
    print(GLOO_ABORT, file=sys.stderr)
    sys.exit(134)
print(f"launch {aborted + 1}")
