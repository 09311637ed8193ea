"""Post-mortems of a run's interruptions, from the controller's bundle: ``read`` checks the bundle, ``build`` makes
the ``Report`` (``model``) of it, ``render`` writes it as Markdown or one HTML page with the ``plots``. Pure (no
I/O, no clock); imports ``opsd.protocol``, ``opsd.policy`` and ``opsd.errors`` only (and matplotlib, for the
plots)."""
