"""The router in front of two real ``python -m server`` replicas on a tiny checkpoint.

The replicas are started the way ``python -m server.router --spawn 2`` starts them
(:func:`server.router.spawn_replicas`); the router runs in the test's event loop, and then as
``python -m server.router --replica URL ...``, a process of its own in front of servers it did
not start, as it would front replicas on other hosts.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import sys

import aiohttp
import pytest
import torch

from minillm.model.checkpoint import save_checkpoint
from minillm.model.config import ModelConfig
from minillm.model.gpt import GPT
from server.connections import running
from server.launch import stop_all
from server.router.replicas import parse_load
from server.router.__main__ import ROUTER, create_router, spawn_replicas
from server.router.config import RouterConfig


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    torch.manual_seed(0)
    model = GPT(ModelConfig(context_length=1024, d_model=64, n_layers=2, n_heads=4)).eval()
    path = tmp_path_factory.mktemp("ckpt") / "ckpt.pt"
    save_checkpoint(path, {"model": model.state_dict(), "model_config": model.cfg.to_dict()})
    config = RouterConfig(spawn=2, checkpoint=str(path), replica_args="--device cpu --kv-cache-memory 16MiB")
    servers = spawn_replicas(config)
    yield [s.url for s in servers]
    assert stop_all(servers) == [0, 0]


def abort_count(metrics: str) -> float:
    match = re.search(r'minillm:request_success_total\{finished_reason="abort"\} (\S+)', metrics)
    return float(match.group(1)) if match else 0.0


async def _through_the_router(urls: list[str]) -> None:
    config = RouterConfig(replicas=urls, policy="prefix")
    app = create_router(urls, config)
    story = "Once upon a time there was a little dog who lived by the sea with his friend the cat, and every day"
    body = {"prompt": story * 2, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    async with running(app) as url, aiohttp.ClientSession() as session:
        homes, texts = [], []
        for _ in range(2):
            async with session.post(f"{url}/v1/completions", json={**body, "stream": True}) as response:
                assert response.status == 200
                homes.append(response.headers["X-Replica"])
                chunks = [json.loads(line[6:]) async for line in response.content
                          if line.startswith(b"data: {")]
                texts.append("".join(c["choices"][0]["text"] for c in chunks))
        assert homes[0] == homes[1]  # the same prefix went home, to the replica that has it cached
        async with session.post(f"{homes[0]}/v1/completions", json=body) as response:
            assert (await response.json())["choices"][0]["text"] == texts[0] == texts[1]
        async with session.get(f"{homes[0]}/metrics") as response:
            assert parse_load(await response.text())["prefix_hit_rate"] > 0

        # A client that walks away from the router: the replica aborts the request.
        before = {u: abort_count(await (await session.get(f"{u}/metrics")).text()) for u in urls}
        long = {"prompt": "The cat", "max_tokens": 1000, "ignore_eos": True, "stream": True}
        response = await session.post(f"{url}/v1/completions", json=long)
        replica = response.headers["X-Replica"]
        assert (await response.content.readuntil(b"\n\n")).startswith(b"data: {")
        response.close()
        # Wait for the abort to land (a state, not a time: the test's overall timeout ends a hang).
        while abort_count(await (await session.get(f"{replica}/metrics")).text()) == before[replica]:
            await asyncio.sleep(0.05)
        for u in urls:  # one abort, on the replica that had the request, and nowhere else
            assert abort_count(await (await session.get(f"{u}/metrics")).text()) == before[u] + (u == replica)
        while any(r.outstanding for r in app[ROUTER].replicas.replicas):  # the router's handler unwinds
            await asyncio.sleep(0.01)


def test_the_router_over_real_replicas(replicas: list[str]) -> None:
    asyncio.run(asyncio.wait_for(_through_the_router(replicas), 60))



def test_the_router_command_fronts_replicas_it_did_not_start(replicas: list[str]) -> None:
    command = [sys.executable, "-m", "server.router", "--port", "0", "--policy", "round-robin"]
    for url in replicas:
        command += ["--replica", url]
    router = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for banner in router.stdout:  # log lines may come first
            if match := re.search(r"serving at (http://\S+) over (.*)   \(Ctrl", banner):
                break
        assert match and match.group(2) == ", ".join(replicas), banner

        async def two_requests() -> list[str]:
            async with aiohttp.ClientSession() as session:
                homes = []
                for _ in range(2):
                    body = {"prompt": "Once upon a time", "max_tokens": 4}
                    async with session.post(f"{match.group(1)}/v1/completions", json=body) as response:
                        assert response.status == 200 and (await response.json())["choices"][0]["text"]
                        homes.append(response.headers["X-Replica"])
                return homes

        assert sorted(asyncio.run(asyncio.wait_for(two_requests(), 60))) == sorted(replicas)  # one each, in turn
        router.send_signal(signal.SIGTERM)
        assert router.wait(timeout=30) == 0
    finally:
        router.kill()
        router.stdout.close()
