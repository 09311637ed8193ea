"""The backends of the Backend port (``opsd.controller.port``): the machine-level steps of a recovery on the
machines a run is on. ``local``: rank processes on this machine (``opsd run``); ``kubernetes``: the nodes and
JobSets of a cluster (``opsd serve --backend kubernetes``); ``fake``: in memory, for tests. Each is an adapter on
what every backend shares (``opsd.controller.steps``) and passes the contract suite of
``tests/backend_contract.py``. Below the API: a backend imports the controller and below, never the API or a
process (``opsd.runtime`` composes those)."""
