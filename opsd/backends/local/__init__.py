"""The local backend: each "node" a group of rank processes plus its own agent on this machine (``processes``),
faults injected for real (``injection``), the port's steps (``backend``), and a run registered, taken up and
brought to its end (``supervise``); ``opsd run`` is the process that does it (``opsd.runtime.local``)."""
