"""A backend that is not opsd's: a plug-in, installed beside opsd, that proves what docs/architecture.md says a new
backend touches ("How to add a backend"). Its machines are a ledger, one JSON file that outlives any controller (as
a scheduler's state does): the nodes and their states, the runs with their nodes and spares, each run's launch, and
each request id's outcome, so that a step asked again (the same controller, or its successor after a crash) answers
what it answered first and changes nothing.

- ``backend``: the adapter (the port's steps on the ledger);
- ``config``: its section of the settings, ``controller.ledger``;
- ``entry``: its ``BackendEntry``, named in the entry-point group ``opsd.backends`` by the distribution the tests
  install (``tests/test_plugin_backend.py``); the contract suite runs it too (``tests/test_backend_contract.py``).
"""
