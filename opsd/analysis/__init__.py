"""Analyses that need no controller: the goodput simulator (``simulation``, ``presets``, ``plots``), the memory and
bubble planner (``planner``), the Flight Recorder analysis (``flight_recorder``: who hung the run) and the flame
graph (``flamegraph``). Pure but for the plots; imports ``opsd.policy`` and ``opsd.protocol``."""
