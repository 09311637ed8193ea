"""The local backend: each "node" a group of rank processes plus its own agent on this machine (``processes``),
faults injected for real (``injection``), the port's steps (``backend``), and ``opsd run`` (``runner``: a
controller, its API and this backend supervising one run)."""
