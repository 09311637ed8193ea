"""The per-node agent: ingests rank reports, watches GPU health, serves /metrics, heartbeats to the controller.

It never imports torch.
"""
