"""The backends of the Backend port (``opsd.controller.port``): the machine-level steps of a recovery on the
machines a run is on. ``local``: rank processes on this machine (``opsd run``); ``fake``: in memory, for tests.
Each passes the contract suite of ``tests/backend_contract.py``. Imports the API (to run a controller of its own,
``opsd run``), the controller and below."""
