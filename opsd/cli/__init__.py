"""The ``opsd`` command line and ``make demo``: the processes (``serve``: agent, serve, run), the operator's commands
(``ops``, over ``connection`` and ``tables``), the analyses (``analysis``), the dashboards' push (``dashboards``),
the settings object (``settings``). The top layer: it may import every other part, and is the only one to import
the agent."""
