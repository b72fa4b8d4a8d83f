"""The load generator (chapter 11): ``python -m server.loadgen``. An HTTP program, free of
torch and of the engine, so it measures any OpenAI-compatible server.

- ``stats``: latency percentiles, TPOT and goodput, with vLLM's definitions.
- ``client``: workloads, open-loop arrival schedules, one timed streaming request.
- ``__main__``: the command: runs, sweeps, reports, JSON and plots.
"""
