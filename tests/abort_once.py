"""For tests/test_launch.py, under torchrun: rank 1 dies of SIGABRT (or, with ``raise``, of a Python error) in
the first N launches (argv[3], default 1; the count is kept in the file argv[1]), then every rank succeeds.
argv[2] is the launch's own directory: it must hold nothing from another launch (files are named by torchrun's run
id); each rank leaves a file there."""

import os
import sys
from pathlib import Path

flag, directory = Path(sys.argv[1]), Path(sys.argv[2])
times = int(sys.argv[3]) if len(sys.argv) > 3 else 1
how = sys.argv[4] if len(sys.argv) > 4 else "abort"
rank, launch = int(os.environ["RANK"]), os.environ["TORCHELASTIC_RUN_ID"]
assert all(p.name.startswith(launch) for p in directory.iterdir()), f"{directory} holds another launch's files"
(directory / f"{launch}-rank{rank}").write_text("started")
if rank == 1:
    failed = int(flag.read_text()) if flag.exists() else 0
    if failed < times:
        flag.write_text(str(failed + 1))
        if how == "raise":
            raise RuntimeError("a Python error, not a crash")
        os.abort()
print(f"rank {rank} ok")
