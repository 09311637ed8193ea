"""The controller: heartbeats in, failures detected, incidents kept, cadence published, runs recovered through the
Backend port (``opsd.controller.port``), state in a SQL store. Imports ``opsd.policy``, ``opsd.protocol``,
``opsd.checkpoints`` and ``opsd.analysis``; never an API framework, a backend, or torch."""
