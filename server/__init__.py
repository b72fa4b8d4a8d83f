"""The HTTP side of minillm: the OpenAI-compatible streaming server, its load generator and
dashboard (chapters 9 and 11), and a router over replicas (chapter 16). It owns no model logic: everything it serves comes from the
engine in :mod:`minillm`, and nothing in :mod:`minillm` imports it.

The server, in data-flow order (``python -m server`` runs it):

- ``config``: the settings, from flags or ``MINILLM_*`` environment variables.
- ``protocol``: OpenAI's request JSON: checking, tokenizing, the chat template.
- ``responses``: OpenAI's response bodies and stream chunks, usage, the model list.
- ``engine_loop``: the engine on its own thread; an inbox in, per-request asyncio queues out.
- ``metrics``: Prometheus metrics with vLLM's names.
- ``app``: the aiohttp routes: auth, errors, streaming, disconnects, the access log.
- ``__main__``: load the model, print how to call it, serve, shut down gracefully.

Around it:

- ``dashboard``: the live page at ``/`` and its event stream, one encoding per tick for every page.
- ``traffic_panel``: the page's bounded load, one run at a time, for the page's own origin only.
- ``launch``: start ``python -m server`` as a child process (chapters 9, 11 and 16, the tests).
- ``signals``: the first SIGINT or SIGTERM stops gracefully, a second at once (server and router).
- ``loadgen/``: chapter 11's load generator, ``python -m server.loadgen``.
- ``router/``: chapter 16's router over replicas, ``python -m server.router``.
"""
