"""Chapter 16's router: ``python -m server.router``, a proxy with the same API in front of
several servers. An HTTP program, free of torch and of the engine.

- ``config``: its flags, or ``MINILLM_ROUTER_*`` environment variables.
- ``policy``: the routing policies (round-robin, least outstanding, load-aware, prefix affinity).
- ``replicas``: each replica's health, ejection and re-admission, and its scraped load.
- ``proxy``: one request forwarded until a replica takes it, relayed, its failures reported.
- ``__main__``: the command: the app, its own /health and /metrics, spawned replicas.
- ``bench``: ``python -m server.router.bench``: replicas, policies and failover, measured.
"""
