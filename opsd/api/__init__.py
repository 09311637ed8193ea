"""The controller's HTTP API (FastAPI on uvicorn): the heartbeat endpoint at the nodes' rate, the operator's
endpoints, the Flight Recorder uploads, ``/metrics`` and ``/healthz``; ``server`` runs it with the detection pass.
Imports the controller and below; never a backend."""
