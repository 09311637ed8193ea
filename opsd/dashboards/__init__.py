"""opsd's Grafana dashboards, built from code (``panels`` of ``widgets``) and written, checked and validated as the
JSON files of ``dashboards/`` (``build``; ``python -m opsd.dashboards write|check DIR``). Imports nothing of opsd."""
