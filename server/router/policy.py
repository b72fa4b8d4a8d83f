"""Routing policies: which replica gets the next request.

A policy is a small pure object: given the healthy replicas not yet tried for this request and
the request's affinity key, it returns one of them. It never does I/O (the router keeps each
:class:`~server.router.replicas.Replica`'s numbers up to date), so plain objects test it.

- ``round-robin``: each replica in turn; fair when requests and replicas are alike.
- ``least-outstanding``: the fewest requests sent and not yet finished. A slow replica holds its
  requests longer, so it gets fewer: nginx's and Envoy's "least connections".
- ``load-aware``: least outstanding, plus what the replica's ``/metrics`` say: its own queue
  (which includes traffic that never passed through this router) and how full its KV cache is.
- ``prefix``: one affinity key (the ``user`` field, else the prompt's start) goes to one
  replica, whose prefix cache then already holds the prompt's blocks. Rendezvous hashing picks
  it, so losing a replica moves only its own keys; a replica far busier than the least busy one
  is skipped (bounded load), so one hot prefix cannot melt it. SGLang's cache-aware router makes
  the same trade between cache hits and balance.

Ties are broken by rotation, so an idle fleet still spreads its requests.
"""

from __future__ import annotations

import hashlib
import json
from typing import Protocol, Sequence

PREFIX_CHARS = 256  # a text prompt's affinity key: its first characters
PREFIX_TOKENS = 64  # a token-id prompt's affinity key: its first token ids
KV_WEIGHT = 4.0  # load-aware: a full KV cache weighs as much as four queued requests
BALANCE_SLACK = 4  # prefix: skip the key's replica when it has this many more outstanding than the least


class ReplicaLoad(Protocol):
    """What a policy may read about a replica (:class:`server.router.replicas.Replica` has it)."""

    url: str
    outstanding: int  # sent by this router and not finished
    waiting: float  # the replica's own queue, from its /metrics (0 until scraped)
    kv_usage: float  # fraction of its KV-cache blocks in use, 0..1, from its /metrics


class Policy:
    """Base class: ``choose(candidates, key)`` returns one of ``candidates`` (never empty). This
    one chooses the lowest ``score``, and among equals the next one in rotation."""

    name = ""

    def __init__(self) -> None:
        self._turn = 0

    def score(self, replica: ReplicaLoad) -> float:
        return 0.0

    def choose(self, candidates: Sequence[ReplicaLoad], key: bytes | None = None) -> ReplicaLoad:
        """The replica for a request whose affinity key is ``key``."""
        best = min(self.score(r) for r in candidates)
        tied = [r for r in candidates if self.score(r) == best]
        self._turn += 1
        return tied[(self._turn - 1) % len(tied)]


class RoundRobin(Policy):
    name = "round-robin"


class LeastOutstanding(Policy):
    name = "least-outstanding"

    def score(self, replica: ReplicaLoad) -> float:
        return replica.outstanding


def load_score(replica: ReplicaLoad) -> float:
    """Load-aware's score: requests in hand, the replica's own queue, and KV pressure."""
    return replica.outstanding + replica.waiting + KV_WEIGHT * replica.kv_usage


class LoadAware(Policy):
    name = "load-aware"

    def score(self, replica: ReplicaLoad) -> float:
        return load_score(replica)


def rendezvous_weight(key: bytes, url: str) -> int:
    """Highest-random-weight hashing: every (key, replica) pair gets a pseudo-random weight and
    the key goes to the heaviest replica. Remove a replica and only its keys move."""
    return int.from_bytes(hashlib.blake2b(key + b"\0" + url.encode(), digest_size=8).digest(), "big")


class PrefixAffinity(Policy):
    name = "prefix"

    def __init__(self, balance_slack: int = BALANCE_SLACK) -> None:
        """``balance_slack``: how many more outstanding requests than the least busy replica
        the key's own replica may have before a request goes elsewhere; 0 never goes elsewhere."""
        super().__init__()
        if balance_slack < 0:
            raise ValueError(f"balance_slack must be >= 0, got {balance_slack}")
        self.balance_slack = balance_slack
        self._fallback = LeastOutstanding()

    def choose(self, candidates: Sequence[ReplicaLoad], key: bytes | None = None) -> ReplicaLoad:
        if key is None:
            return self._fallback.choose(candidates)
        home = max(candidates, key=lambda r: rendezvous_weight(key, r.url))
        least = min(r.outstanding for r in candidates)
        if home.outstanding - least >= self.balance_slack > 0:
            return self._fallback.choose(candidates)
        return home


POLICIES: dict[str, type[Policy]] = {p.name: p for p in (RoundRobin, LeastOutstanding, LoadAware, PrefixAffinity)}


def affinity_key(body: object) -> bytes | None:
    """The key that ``prefix`` routes on: the ``user`` field when a client names its session,
    else the start of the prompt (the chat messages, serialized, for a chat request). None
    when the body has neither (the router still forwards it; the replica will judge it)."""
    if not isinstance(body, dict):
        return None
    if isinstance(body.get("user"), str) and body["user"]:
        return b"user:" + body["user"].encode()
    if isinstance(body.get("messages"), list) and body["messages"]:
        chat = json.dumps(body["messages"], sort_keys=True, separators=(",", ":"))
        return b"chat:" + chat[:PREFIX_CHARS].encode()
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of prompts: its first one
    if isinstance(prompt, str) and prompt:
        return b"text:" + prompt[:PREFIX_CHARS].encode()
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return b"ids:" + json.dumps(prompt[:PREFIX_TOKENS]).encode()
    return None
