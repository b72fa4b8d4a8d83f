"""The HTTP side of minillm: the OpenAI-compatible streaming server (``python -m server``), its
dashboard and load generator (chapters 9 and 11), and a router over replicas (chapter 17). It
owns no model logic: what it serves comes from :mod:`minillm`, which never imports it.

The server, in data-flow order: ``config`` (flags), ``protocol`` (request JSON in),
``engine_loop`` (the engine on its own thread), ``responses`` (JSON out), ``metrics``, ``app``
(the routes), ``__main__``. ``loadgen/`` and ``router/`` are programs of their own, free of torch.
"""
