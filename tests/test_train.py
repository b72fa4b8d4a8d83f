import contextlib
import math
import os
import subprocess
import sys

import pytest
import torch

from minillm.model.checkpoint import load_model, load_state, preset_dir
from minillm.train.trainer import load_or_train
from minillm.data.corpus import BatchSampler, prepare_corpus
from minillm.model.gpt import GPT
from minillm.train.trainer import TrainConfig, evaluate, lr_at, make_optimizer, resolve, train, train_step

SMALL = dict(preset="tiny", data="synthetic", max_stories=200, dtype="float32", progress=False, eval_batches=2)


def weights(path):
    return load_state(path)["model"]


def test_resume_continues_exactly(home):
    train(TrainConfig(**SMALL, max_steps=6, eval_every=3, out=str(home / "straight")))
    train(TrainConfig(**SMALL, max_steps=6, eval_every=3, stop_after=3, out=str(home / "split")))
    assert load_state(home / "split")["step"] == 3
    train(TrainConfig(**SMALL, max_steps=6, eval_every=3, resume=True, out=str(home / "split")))
    a, b = weights(home / "straight"), weights(home / "split")
    assert load_state(home / "split")["step"] == 6
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_a_few_steps_reduce_the_loss_on_a_fixed_batch():
    torch.manual_seed(0)
    model = GPT(resolve(TrainConfig(preset="tiny"))[1])
    cfg = resolve(TrainConfig(preset="tiny", lr=3e-3))[0]
    opt = make_optimizer(model, cfg)
    x = torch.randint(0, 1000, (4, 32))
    batch = [(x[:, :-1], x[:, 1:])]
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    import contextlib

    losses = [train_step(model, opt, scaler, contextlib.nullcontext(), batch, 1.0) for _ in range(40)]
    assert losses[-1] < 0.5 * losses[0]


def test_training_writes_metrics_and_a_loadable_model(home):
    metrics = train(TrainConfig(**SMALL, max_steps=4, eval_every=2, out=str(home / "run")))
    assert metrics["step"] == 4
    corpus = prepare_corpus("synthetic", max_stories=200, verbose=False)
    cfg = resolve(TrainConfig(**SMALL))[0]
    again = evaluate(load_model(home / "run"), corpus, cfg.seq_len, cfg.batch_size, cfg.eval_batches, contextlib.nullcontext())
    assert metrics["val_loss"] == pytest.approx(again["val_loss"], rel=1e-5)  # the saved model is the evaluated one
    assert metrics["val_loss"] < math.log(50257)  # four steps already beat guessing uniformly
    assert (home / "run" / "history.json").is_file()
    model = load_model(home / "run")
    assert not model.training and model.cfg.d_model == 64
    history = load_state(home / "run")["history"]
    assert [h["step"] for h in history] == [1, 2, 3, 4]
    counts = load_state(home / "run")["data"]["token_counts"]  # what a draft model's vocabulary is cut to
    train_tokens = torch.from_numpy(corpus.tokens("train").astype("int64"))
    assert counts.shape == (50257,) and torch.equal(counts, torch.bincount(train_tokens, minlength=50257))


def test_evaluation_of_a_model_that_guesses_uniformly_is_the_log_of_the_vocabulary(home):
    """All-zero weights give equal logits everywhere: the loss is ln(vocab) exactly, the
    perplexity the vocabulary's size, and bits per byte that loss in bits spread over the
    split's bytes; an average that lost windows or mixed splits would still be ln(vocab), so
    the bytes are checked against the split's own counts."""
    corpus = prepare_corpus("synthetic", max_stories=200, verbose=False)
    model = GPT(resolve(TrainConfig(preset="tiny"))[1])
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    m = evaluate(model, corpus, 32, 4, 3, contextlib.nullcontext())
    vocab, split = model.cfg.vocab_size, corpus.stats("validation")
    assert m["val_loss"] == pytest.approx(math.log(vocab), rel=1e-6)
    assert m["val_ppl"] == pytest.approx(vocab, rel=1e-5)
    assert m["val_bpb"] == pytest.approx(math.log2(vocab) * split["tokens"] / split["bytes"], rel=1e-6)
    assert split["tokens"] == len(corpus.tokens("validation")) and split["tokens"] != corpus.stats("train")["tokens"]


def test_learning_rate_schedule():
    cfg = resolve(TrainConfig(preset="tiny", max_steps=100, warmup=10, lr=1.0))[0]
    lrs = [lr_at(s, cfg) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:]))  # decays monotonically after warm-up
    assert lrs[-1] == pytest.approx(cfg.min_lr_ratio, abs=0.01)


def test_weight_decay_only_on_matrices():
    model = GPT(resolve(TrainConfig(preset="tiny"))[1])
    decayed, plain = make_optimizer(model, resolve(TrainConfig(preset="tiny"))[0]).param_groups
    assert all(p.dim() == 2 for p in decayed["params"]) and all(p.dim() == 1 for p in plain["params"])
    assert decayed["weight_decay"] > 0 and plain["weight_decay"] == 0


def test_load_or_train_trains_once_then_loads(home, monkeypatch):
    monkeypatch.setenv("MINILLM_QUICK", "1")
    model = load_or_train("tiny", device="cpu")
    path = preset_dir("tiny") / "ckpt.pt"
    stamp = path.stat().st_mtime_ns
    again = load_or_train("tiny", device="cpu")
    assert path.stat().st_mtime_ns == stamp
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))


def test_ddp_on_two_cpu_processes_equals_one_process_on_both_batches(home):
    """Two gloo ranks, each on its own shard, average their gradients: the same as one process
    training on both ranks' batches together."""
    out = home / "ddp"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "minillm.train",
           "--preset", "tiny", "--data", "synthetic", "--max-stories", "200", "--max-steps", "2", "--eval-every", "2",
           "--dtype", "float32", "--out", str(out)]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]

    cfg, model_cfg = resolve(TrainConfig(**SMALL, max_steps=2, eval_every=2), world_size=2)
    torch.manual_seed(cfg.seed)
    model = GPT(model_cfg)
    opt = make_optimizer(model, cfg)
    tokens = prepare_corpus("synthetic", max_stories=200, verbose=False).tokens("train")
    ranks = [BatchSampler(tokens, cfg.batch_size, cfg.seq_len, seed=cfg.seed, rank=r, world_size=2) for r in (0, 1)]
    import contextlib

    scaler = torch.amp.GradScaler("cpu", enabled=False)
    for step in range(2):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        xs, ys = zip(*(r.batch(step) for r in ranks))
        train_step(model, opt, scaler, contextlib.nullcontext(), [(torch.cat(xs), torch.cat(ys))], cfg.grad_clip)
    ddp = weights(out)
    for name, p in model.state_dict().items():
        assert torch.allclose(p, ddp[name], atol=1e-5), name


def run_train(*args):
    return subprocess.run([sys.executable, "-m", "minillm.train", *args], capture_output=True, text=True)


@pytest.mark.parametrize("args, words", [
    (["--preset", "tiny", "--batch-size", "0"], "batch-size"),
    (["--preset", "tiny", "--seq-len", "1000"], "longer than"),
    (["--preset", "tiny", "--data", "/no/such/stories.txt", "--max-steps", "1"], "/no/such/stories.txt"),
    (["--preset", "huge"], "--preset"),
    (["--preset", "tiny", "--lr", "fast"], "--lr"),
])
def test_bad_flags_give_one_line(home, args, words):
    result = run_train(*args)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and words in lines[0] and "Traceback" not in result.stderr


def test_quick_runs_keep_their_checkpoints_apart(home, monkeypatch) -> None:
    from minillm.model.checkpoint import preset_dir

    monkeypatch.setenv("MINILLM_QUICK", "1")
    quick_dir = preset_dir("cpu")
    monkeypatch.setenv("MINILLM_QUICK", "0")
    assert preset_dir("cpu") == home / "checkpoints" / "cpu"
    assert quick_dir == home / "checkpoints" / "quick" / "cpu"


def test_measure_throughput_is_tokens_over_step_time(monkeypatch) -> None:
    from minillm.train import trainer as T

    now = [500.0]  # a fake clock: it moves only when a step says so, so the rate is exact
    durations = [2.0, 0.25, 0.125, 0.5]  # a slow warm-up, then three timed steps
    calls: list[int] = []

    def step(*args, **kwargs) -> None:
        now[0] += durations[len(calls)]
        calls.append(1)

    monkeypatch.setattr(T, "train_step", step)
    rate = T.measure_throughput("tiny", batch_size=2, seq_len=16, steps=3, device="cpu", clock=lambda: now[0])
    assert len(calls) == 4  # one warm-up, three timed
    assert rate == 2 * 16 / 0.25  # 32 tokens over the median timed step; the warm-up left out


def test_every_version_of_the_step_trains_the_same_weights() -> None:
    """The fused loss and the fused AdamW are speed, not a different training run: three steps
    of each version of chapter 4's benchmark end at the same weights as the plain step."""
    from minillm.bench import training as TB

    ends = {}
    for name, (fused_loss, fused_opt) in TB.VARIANTS.items():
        model, optimizer, amp, scaler, batch = TB._setup("tiny", 4, 32, "float32", torch.device("cpu"), fused_opt)
        runner = model if fused_loss else TB.PlainLoss(model)
        for _ in range(3):
            train_step(runner, optimizer, scaler, amp, [batch], 1.0)
        ends[name] = model.state_dict()
    plain = ends.pop("plain")
    for name, state in ends.items():
        for key in plain:
            torch.testing.assert_close(state[key], plain[key], rtol=1e-4, atol=1e-5, msg=f"{name}: {key}")


def test_the_forecast_is_steps_and_evaluations_at_the_measured_rate(monkeypatch) -> None:
    from minillm.train import trainer as T

    monkeypatch.setattr(T, "measure_throughput", lambda *a, **k: 1000.0)
    text = T.forecast(TrainConfig(preset="tiny", max_tokens=60 * 8 * 64, eval_every=30, eval_batches=3, batch_size=8, device="cpu"))
    # 8 x 64 tokens a step at 1,000 tokens/s: 60 steps of 0.512 s, and 2 evaluations of 3 batches at a third of that
    assert "about 32 seconds" in text and "60 steps at 1,000 tokens/s" in text and "2 evaluations" in text


@pytest.mark.parametrize("has_units, bf16, fp32, expected", [
    (False, 400e9, 100e9, None),  # no bf16 instructions: emulated, never timed
    (True, 145e9, 244e9, None),  # the instructions, but slower than fp32 (AVX-512 BF16 without AMX)
    (True, 900e9, 244e9, torch.bfloat16),  # AMX: bf16 pays
])
def test_auto_trains_a_cpu_in_bf16_only_where_it_measures_faster(monkeypatch, has_units, bf16, fp32, expected) -> None:
    import minillm.train.trainer as T

    monkeypatch.setattr(T, "cpu_has_bf16_matmul", lambda: has_units)
    monkeypatch.setattr(T, "measure_matmul_flops", lambda device, dtype, n: bf16 if dtype == torch.bfloat16 else fp32)
    T.cpu_bf16_pays.cache_clear()
    try:
        assert T.autocast_dtype(TrainConfig(dtype="auto"), torch.device("cpu")) == expected
        assert T.autocast_dtype(TrainConfig(dtype="float32"), torch.device("cpu")) is None
        assert T.autocast_dtype(TrainConfig(dtype="bfloat16"), torch.device("cpu")) == torch.bfloat16
    finally:
        T.cpu_bf16_pays.cache_clear()


@pytest.mark.parametrize("dtype, peak_name", [("float32", "fp32"), ("bfloat16", "bf16")])
def test_the_bar_s_mfu_divides_by_the_peak_of_the_dtype_the_matmuls_run_in(home, monkeypatch, capsys, dtype, peak_name) -> None:
    import minillm.train.trainer as T
    from minillm.model.gpt import training_flops_per_token

    # Peaks far apart, so dividing by the other dtype's would be off by 4x.
    peaks = {torch.float32: 100e9, torch.bfloat16: 400e9}
    monkeypatch.setattr(T, "matmul_peak", lambda device, dtype=torch.float32: peaks[dtype])
    cfg = TrainConfig(**{**SMALL, "dtype": dtype, "progress": True}, max_steps=2, eval_every=2, out=str(home / dtype))
    train(cfg)
    run_cfg, model_cfg = resolve(cfg)
    per_token = training_flops_per_token(model_cfg, run_cfg.seq_len)
    peak = peaks[getattr(torch, dtype)]
    for h in load_state(home / dtype)["history"]:
        assert h["mfu"] == pytest.approx(h["tok_s"] * per_token / peak, rel=1e-9)
    out, err = capsys.readouterr()
    assert f"measured {peak_name} matmul peak ({peak / 1e9:,.0f} GFLOP/s)" in out
    assert f"of {peak_name} peak" in err
