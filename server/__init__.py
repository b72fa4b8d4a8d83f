"""The HTTP side of minillm: the OpenAI-compatible streaming server, its load generator and
dashboard (chapters 9 and 10). It owns no model logic: everything it serves comes from the
engine in :mod:`minillm`, and nothing in :mod:`minillm` imports it.

The server, in data-flow order (``python -m server`` runs it):

- ``config``: the settings, from flags or ``MINILLM_*`` environment variables.
- ``protocol``: OpenAI's request and response JSON: checking, tokenizing, the chat template.
- ``engine_loop``: the engine on its own thread; an inbox in, per-request asyncio queues out.
- ``metrics``: Prometheus metrics with vLLM's names.
- ``app``: the aiohttp routes: auth, errors, streaming, disconnects, the access log.
- ``__main__``: load the model, print how to call it, serve, shut down gracefully.

Around it, chapter 10's tools:

- ``loadgen_stats``: latency percentiles, TPOT and goodput, with vLLM's definitions.
- ``loadgen_client``: workloads, open-loop arrival schedules, one timed streaming request.
- ``loadgen``: ``python -m server.loadgen``: runs, sweeps, reports, JSON and plots.
- ``dashboard``: the live page at ``/``, its event stream and its bounded traffic panel.
"""
