"""A split model across hosts, rehearsed on one machine: two ``torchrun`` launchers on
127.0.0.1 (gloo), as two hosts would run them, serving over HTTP and from a script; and the
faults a launch must report clearly (a killed worker, a worker that cannot start, flags that
differ), plus the one-machine spawn path's own start-up faults."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request

import pytest

from minillm.distributed.rendezvous import Rank, launched
from minillm.distributed.workers import WorkerLost
from minillm.engine import LLM, SamplingParams
from minillm.model.checkpoint import save_checkpoint
from server.launch import server_command, start_server, torchrun
from tests.models import lively_tiny

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
PROMPT = "Once upon a time there was a little dog"
SERVER_FLAGS = ("--device", "cpu", "--kv-cache-memory", "16MiB")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    model = lively_tiny()
    path = tmp_path_factory.mktemp("ckpt") / "tiny.pt"
    save_checkpoint(path, {"model": model.state_dict(), "model_config": model.cfg.to_dict()})
    return path


@pytest.fixture(scope="module")
def one_process(checkpoint) -> str:
    """What the model says to ``PROMPT`` in one process: every split must say the same."""
    with LLM(str(checkpoint), device="cpu") as llm:
        return llm.generate([PROMPT], SamplingParams(max_tokens=12, temperature=0), use_tqdm=False)[0].text


def endpoint() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def start_host(command: list[str]) -> subprocess.Popen:
    """One of the two "hosts": its torchrun launcher running ``command``, output captured."""
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV)


def host(node_rank: int, where: str, checkpoint, *flags: str) -> subprocess.Popen:
    """Host ``node_rank``'s launcher running the server on ``checkpoint``."""
    return start_host(server_command(checkpoint, *SERVER_FLAGS, *flags, launcher=torchrun(node_rank, 2, where)))


def finish(process: subprocess.Popen, timeout: float = 60) -> tuple[int, str]:
    output, _ = process.communicate(timeout=timeout)
    return process.returncode, output


def complete(url: str) -> str:
    body = json.dumps({"prompt": PROMPT, "max_tokens": 12, "temperature": 0}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())["choices"][0]["text"]


@pytest.mark.parametrize("split", ["--tensor-parallel-size", "--pipeline-parallel-size"])
def test_two_launchers_serve_what_one_process_does_and_sigterm_stops_both(checkpoint, one_process, split):
    where = endpoint()
    worker = host(1, where, checkpoint, split, "2")
    server = start_server(checkpoint, *SERVER_FLAGS, split, "2", launcher=torchrun(0, 2, where), env=ENV, timeout=120)
    try:
        rank_0, rank_1 = server.rank_pids()
        assert complete(server.url) == one_process
        os.kill(rank_0, signal.SIGTERM)  # the server itself, not its launcher: a graceful stop
        assert server.proc.wait(timeout=60) == 0, server.output()
        code, output = finish(worker)
        assert code == 0, output
        with pytest.raises(ProcessLookupError):
            os.kill(rank_1, 0)
    finally:
        server.kill()
        worker.kill()


def test_a_script_launched_on_two_hosts_generates_what_one_process_does(checkpoint, one_process, tmp_path):
    script = tmp_path / "generate.py"
    script.write_text(textwrap.dedent(f"""
        from minillm.engine import LLM, SamplingParams
        llm = LLM({str(checkpoint)!r}, device="cpu", pipeline_parallel_size=2)  # never returns on rank 1
        out = llm.generate([{PROMPT!r}], SamplingParams(max_tokens=12, temperature=0), use_tqdm=False)
        print("TEXT", repr(out[0].text))
        llm.close()
    """))
    where = endpoint()
    hosts = [start_host([*torchrun(r, 2, where), str(script)]) for r in (0, 1)]
    (code_0, output_0), (code_1, output_1) = [finish(h) for h in hosts]
    assert (code_0, code_1) == (0, 0), output_0 + output_1
    assert f"TEXT {one_process!r}" in output_0
    assert "TEXT" not in output_1  # rank 1 served rank 0 and ended inside LLM(...)


def test_a_killed_worker_is_named_by_rank_0_which_exits(checkpoint):
    where = endpoint()
    worker = host(1, where, checkpoint, "--pipeline-parallel-size", "2")
    server = start_server(checkpoint, *SERVER_FLAGS, "--pipeline-parallel-size", "2", launcher=torchrun(0, 2, where),
                          env=ENV, timeout=120)
    try:
        _, rank_1 = server.rank_pids()
        os.kill(rank_1, signal.SIGKILL)
        start = time.monotonic()
        code = server.proc.wait(timeout=30)  # noticed while idle, with no request to fail
        assert code != 0 and time.monotonic() - start < 10
        time.sleep(0.2)  # the last lines through the output pump
        assert re.search(r"pipeline stage rank 1 \(\S+ pid \d+\) closed its connection without a word",
                         server.output()), server.output()
        assert finish(worker)[0] != 0
    finally:
        server.kill()
        worker.kill()


@pytest.mark.parametrize("split, rank_1_flag, message", [
    ("--pipeline-parallel-size", "8", r"--max-num-seqs: max_num_seqs differs between ranks: rank 0 has 256, rank 1 has 8"),
    ("--tensor-parallel-size", "0",
     r"tensor-parallel worker rank 1 failed while starting: --max-num-seqs: max_num_seqs must be >= 1, got 0"),
])
def test_a_worker_that_cannot_start_or_disagrees_is_named_by_rank_0(checkpoint, split, rank_1_flag, message):
    where = endpoint()
    hosts = [host(0, where, checkpoint, split, "2"), host(1, where, checkpoint, split, "2", "--max-num-seqs", rank_1_flag)]
    (code_0, output_0), (code_1, output_1) = [finish(h) for h in hosts]
    assert code_0 != 0 and code_1 != 0
    assert re.search(f"^python -m server: error: {message}$", output_0, re.MULTILINE), output_0  # one line, no trace


def test_a_spawned_worker_that_dies_while_starting_is_reported_with_its_own_words(tmp_path, monkeypatch):
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho \"ModuleNotFoundError: No module named 'torch'\" >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(fake))  # what the spawn path starts each worker with
    start = time.monotonic()
    with pytest.raises(WorkerLost, match=r"rank 1 stopped while starting: it exited with code 1; its last lines:\nModuleNotFoundError: No module named 'torch'$"):
        LLM(lively_tiny(), pipeline_parallel_size=2)
    assert time.monotonic() - start < 30


def test_a_script_read_from_standard_input_can_split_its_model():
    """The spawned workers import nothing from the script that started them (it may have no file)."""
    code = ("from tests.models import lively_tiny\n"
            "from minillm.engine import LLM, SamplingParams\n"
            "with LLM(lively_tiny(), pipeline_parallel_size=2) as llm:\n"
            "    print('TOKENS', llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0),"
            " use_tqdm=False)[0].token_ids)\n")
    result = subprocess.run([sys.executable, "-"], input=code, capture_output=True, text=True, timeout=120,
                            env={**ENV, "PYTHONPATH": os.getcwd()})
    assert result.returncode == 0, result.stderr[-2000:]
    with LLM(lively_tiny()) as llm:
        expected = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)[0].token_ids
    assert f"TOKENS {expected}" in result.stdout


def test_a_launch_is_read_from_torchruns_environment(monkeypatch):
    for name, value in {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "10.0.0.1",
                        "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(name, value)
    assert launched() == Rank(rank=1, world_size=2, local_rank=0)
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert launched() is None  # launched alone: one process, nothing to split over
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("MASTER_PORT")
    assert launched() is None  # not torchrun's environment
