"""torchft's Lighthouse, started without importing torch: ``python opsd/backends/local/lighthouse.py --min_replicas 1
...`` (the local backend starts it beside the controller for a fault-tolerant run; ``examples.ft_launch`` too).

The ``torchft_lighthouse`` console script imports the ``torchft`` package, which imports torch: seconds of start-up
(measured here: 2 s idle, up to 18 s on a loaded machine), during which every replica group waits for its next
quorum. The Lighthouse itself is torchft's Rust extension; this loads the extension alone and runs the console
script's entry point with the same options (``opsd.protocol.ft.LighthouseConfig.argv``). Where the extension is not
found, it runs the console script's way.

Run it as a script, not with ``python -m``: the entry point parses the process's own arguments after the
interpreter's name, and takes the first of them for the program's name.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any


def load_extension() -> Any:
    """torchft's extension module, loaded from the installed package's directory without running its
    ``__init__`` (which imports torch)."""
    spec = importlib.util.find_spec("torchft")  # a top-level package is found, not run
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        for path in sorted(Path(location).glob("_torchft*.so")):
            extension = importlib.util.spec_from_file_location("torchft._torchft", path)
            if extension is not None and extension.loader is not None:
                module = importlib.util.module_from_spec(extension)
                extension.loader.exec_module(module)
                return module
    from torchft import _torchft  # the package's way (imports torch)

    return _torchft


def main() -> int:
    sys.argv[0] = "torchft_lighthouse"
    return int(load_extension().lighthouse_main() or 0)


if __name__ == "__main__":
    sys.exit(main())
