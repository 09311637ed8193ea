"""The controller's HTTP API (FastAPI): the heartbeat endpoint at the nodes' rate, the operator's endpoints, the
Flight Recorder uploads, ``/metrics`` and ``/healthz``, each for the roles that may call it. Imports the controller
and below, and the backends (below it); the process that serves it is ``opsd.runtime``."""
