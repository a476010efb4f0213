"""The shipped workloads on their real data: Debian KJV text, Fashion-MNIST, sklearn digits."""

from __future__ import annotations

import gzip
import math
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from jobs.config import ConfigError, WorkloadSection, load_config
from jobs.data import KJV_PACKAGES, digits, fashion_mnist, kjv_corpus, kjv_text, read_idx
from jobs.models import char_lstm, char_transformer, evaluate_lm, lm_loss
from jobs.workloads import Workload, build, metric_of, optimizer_for

GENESIS = "In the beginning God created the heaven and the earth."


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A private cache dir so tests neither read nor write ~/.cache."""
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def small(cache):
    return kjv_corpus(cache, max_chars=200_000)


def test_kjv_text_is_the_whole_bible_as_clean_verses(cache):
    text = kjv_text(cache)
    assert len(text) > 4_000_000
    assert text.startswith(GENESIS + "\nAnd the earth was without form")
    assert text.endswith("The grace of our Lord Jesus Christ be with you all. Amen.\n")
    assert "Genesis" not in text[:1000]  # no chapter headings ...
    assert not any(line[:1].isdigit() for line in text.splitlines())  # ... nor verse numbers
    assert text.count("\n\n") == 1188  # 1,189 chapters, a blank line between each


def test_kjv_text_is_cached_in_the_given_dir(tmp_path):
    start = time.perf_counter()
    first = kjv_text(tmp_path)
    assert (tmp_path / "kjv.txt").read_text() == first
    assert [p.name for p in tmp_path.iterdir()] == ["kjv.txt"]  # no temp file left behind
    (tmp_path / "kjv.txt").write_text("edited")
    assert kjv_text(tmp_path) == "edited"  # read from the cache, not dumped again
    assert time.perf_counter() - start < 5


def test_kjv_cache_dir_comes_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("RAYCOMP_CACHE_DIR", str(tmp_path / "env"))
    assert kjv_text().startswith(GENESIS)
    assert (tmp_path / "env" / "kjv.txt").exists()


def test_missing_bible_program_names_the_debian_packages(tmp_path, monkeypatch):
    (tmp_path / "bin").mkdir()
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    with pytest.raises(FileNotFoundError, match=KJV_PACKAGES):
        kjv_text(tmp_path)
    assert not (tmp_path / "kjv.txt").exists()


def test_corpus_vocab_round_trip_and_contiguous_split(cache, small):
    full = kjv_corpus(cache)
    assert full.vocab == "".join(sorted(set(kjv_text(cache))))
    assert full.vocab_size == 63
    assert len(full.test) == int(0.05 * (len(full.train) + len(full.test)))
    assert full.decode(full.train[:len(GENESIS)]) == GENESIS
    assert small.decode(torch.cat([small.train, small.test])) == kjv_text(cache)[:200_000]
    tokens = small.encode("Let there be light.\n")
    assert tokens.dtype == torch.int64
    assert small.decode(tokens) == "Let there be light.\n"


def test_batches_are_next_char_windows_fixed_by_seed_epoch_step_and_rank(small):
    args = dict(split="train", epoch=3, step=7, world_size=2, batch_size=4, block=16, seed=1)
    x, y = small.batch_at(rank=0, **args)
    assert x.shape == y.shape == (4, 16)
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert torch.equal(x, small.batch_at(rank=0, **args)[0])
    x1, _ = small.batch_at(rank=1, **args)
    assert not torch.equal(x, x1)
    assert not torch.equal(x, small.batch_at(rank=0, **{**args, "step": 8})[0])
    assert not torch.equal(x, small.batch_at(rank=0, **{**args, "epoch": 4})[0])
    assert not torch.equal(x, small.batch_at(rank=0, **{**args, "seed": 2})[0])
    # together the ranks draw what one process with the global batch draws
    solo, _ = small.batch_at(rank=0, **{**args, "world_size": 1, "batch_size": 8})
    assert torch.equal(torch.cat([x, x1]), solo)
    # resuming at step 5 replays exactly the tail of the epoch
    full = list(small.epoch_batches("train", 0, 1, 2, 4, 16, steps=8, seed=1))
    resumed = list(small.epoch_batches("train", 0, 1, 2, 4, 16, steps=8, seed=1, start=5))
    assert len(full) == 8
    assert all(torch.equal(a[0], b[0]) for a, b in zip(full[5:], resumed, strict=True))


def test_sample_uses_only_the_given_generator(small):
    torch.manual_seed(0)
    a = small.sample("test", 4, 32, torch.Generator().manual_seed(5))
    torch.manual_seed(1)  # the global RNG must not matter
    b = small.sample("test", 4, 32, torch.Generator().manual_seed(5))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    with pytest.raises(ValueError, match="split"):
        small.sample("valid", 4, 32, torch.Generator())


def test_char_transformer_is_causal():
    torch.manual_seed(0)
    model = char_transformer(10, block=16, d_model=32, heads=2).eval()
    x = torch.randint(10, (2, 16))
    changed = x.clone()
    changed[:, 10:] = (x[:, 10:] + 1) % 10
    with torch.no_grad():
        a, b = model(x), model(changed)
    assert a.shape == (2, 16, 10)
    assert torch.allclose(a[:, :10], b[:, :10], atol=1e-5)
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def _fit_lm(model: torch.nn.Module, opt: torch.optim.Optimizer, corpus, steps: int = 150) -> tuple[float, float]:
    """Test loss before and after ``steps`` steps of 32 windows of 64 characters."""
    before = evaluate_lm(model, corpus.test, 64)
    for x, y in corpus.epoch_batches("train", 0, 0, 1, batch_size=32, block=64, steps=steps):
        opt.zero_grad()
        lm_loss(model(x), y).backward()
        opt.step()
    return before, evaluate_lm(model, corpus.test, 64)


def test_char_transformer_learns_the_kjv(small):
    torch.manual_seed(0)
    vocab = small.vocab_size
    counts = torch.bincount(small.train, minlength=vocab).double() / len(small.train)
    unigram = float(-(counts[counts > 0] * counts[counts > 0].log()).sum())
    model = char_transformer(vocab, block=64, d_model=64)
    before, after = _fit_lm(model, torch.optim.AdamW(model.parameters(), lr=3e-3), small)
    print(f"test loss {before:.3f} -> {after:.3f} nats; ln(vocab) {math.log(vocab):.3f}, "
          f"unigram entropy {unigram:.3f}")
    assert model.training  # evaluate_lm restores the mode
    assert before > 0.95 * math.log(vocab)
    assert after < 0.8 * math.log(vocab)
    assert after < unigram - 0.4  # it uses context, not just character frequencies


def test_char_lstm_learns_the_kjv_with_momentum_sgd(small):
    torch.manual_seed(0)
    vocab = small.vocab_size
    model = char_lstm(vocab, d_model=64)
    assert model(torch.randint(vocab, (2, 16))).shape == (2, 16, vocab)
    before, after = _fit_lm(model, torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9), small)
    print(f"test loss {before:.3f} -> {after:.3f} nats; ln(vocab) {math.log(vocab):.3f}")
    assert before > 0.95 * math.log(vocab)
    assert after < 0.8 * math.log(vocab)


def test_the_shipped_lstm_config_builds_a_1_1m_parameter_lstm_trained_with_sgd(cache, monkeypatch):
    from tests.support.repo import REPO

    monkeypatch.setenv("RAYCOMP_CACHE_DIR", str(cache))
    config = load_config(REPO / "jobs" / "configs" / "lstm_kjv.yaml", [])
    workload = build(config.workload, rank=0, world_size=2, seed=0)
    # what the config's comment says: 1.1M parameters, 97% of them in the four LSTM matrices
    assert 1.05e6 < workload.parameters < 1.15e6 and workload.metric == "loss"
    sizes = {name: p.numel() for name, p in workload.model.named_parameters()}
    matrices = sum(sizes[f"lstm.weight_{kind}_l{layer}"] for kind in ("ih", "hh") for layer in (0, 1))
    assert matrices / workload.parameters > 0.96
    opt, scheduler = optimizer_for(config.workload, workload.model, total_steps=400)
    assert isinstance(opt, torch.optim.SGD) and scheduler is not None  # linear in the gradient: lossy rungs on
    with pytest.raises(ConfigError, match=r"^workload\.model: .*'transformer', 'lstm'"):
        load_config(REPO / "jobs" / "configs" / "lstm_kjv.yaml", ["workload.model=gru"])


def test_fashion_mnist_shapes_and_labels():
    train, test = fashion_mnist()
    assert train.x.shape == (60000, 1, 28, 28) and test.x.shape == (10000, 1, 28, 28)
    assert train.y.dtype == torch.int64
    assert set(train.y.unique().tolist()) == set(range(10)) == set(test.y.unique().tolist())
    assert abs(float(train.x.mean())) < 0.05 and abs(float(train.x.std()) - 1) < 0.05


def test_digits_shapes():
    train, test = digits()
    assert train.x.shape == (1438, 64) and test.x.shape == (359, 64)
    assert float(train.x.max()) <= 1.0
    assert len(train.shard(1, 2)) == 719


def test_read_idx_rejects_truncated_and_foreign_files(tmp_path):
    good = np.arange(12, dtype=np.uint8).reshape(3, 4)
    header = bytes([0, 0, 8, 2]) + np.array([3, 4], dtype=">u4").tobytes()
    path = tmp_path / "ok-idx2-ubyte.gz"
    path.write_bytes(gzip.compress(header + good.tobytes()))
    assert np.array_equal(read_idx(path), good)
    truncated = tmp_path / "short-idx2-ubyte"
    truncated.write_bytes(header + good.tobytes()[:-1])
    with pytest.raises(ValueError, match="header says"):
        read_idx(truncated)
    foreign = tmp_path / "float-idx2-ubyte"
    foreign.write_bytes(bytes([0, 0, 0x0D, 2]) + header[4:])
    with pytest.raises(ValueError, match="not an unsigned-byte IDX"):
        read_idx(foreign)


# --- the shipped communication-bound workloads (jobs/configs) ---------------------------------
REPO = Path(__file__).resolve().parents[1]
GPT_PARAMETERS = 3_224_639  # documented in jobs/configs/gpt_kjv.yaml
CNN_PARAMETERS = 2_506_346  # documented in jobs/configs/cnn_fashion.yaml


def _config(name: str, *overrides: str):
    return load_config(REPO / "jobs" / "configs" / f"{name}.yaml", list(overrides)).workload


@pytest.fixture(scope="module")
def kjv_cached(cache):
    """Workloads read the KJV from $RAYCOMP_CACHE_DIR: point it at the test's private cache."""
    kjv_text(cache)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RAYCOMP_CACHE_DIR", str(cache))
        yield cache


@pytest.fixture(scope="module")
def gpt(kjv_cached):
    return _config("gpt_kjv")


@pytest.fixture(scope="module")
def cnn():
    return _config("cnn_fashion")


def test_shipped_configs_have_the_documented_sizes(gpt, cnn):
    g = build(gpt, 0, 2, seed=0)
    assert g.parameters == GPT_PARAMETERS and g.metric == "loss" and g.lower_is_better
    assert f"{GPT_PARAMETERS:,}" in (REPO / "jobs/configs/gpt_kjv.yaml").read_text()
    assert (gpt.batch_size * gpt.block, gpt.block, gpt.eval_every_steps) == (768, 128, 50)
    c = build(cnn, 1, 2, seed=0)
    assert c.parameters == CNN_PARAMETERS and c.metric == "accuracy" and not c.lower_is_better
    assert f"{CNN_PARAMETERS:,}" in (REPO / "jobs/configs/cnn_fashion.yaml").read_text()
    assert any(isinstance(m, torch.nn.BatchNorm2d) for m in c.model.modules())
    # same seed, same initial weights on every rank; another seed, other weights
    again = build(gpt, 1, 2, seed=0).model.state_dict()
    assert all(torch.equal(v, again[k]) for k, v in g.model.state_dict().items())
    other = build(gpt, 0, 2, seed=1).model.state_dict()
    assert not all(torch.equal(v, other[k]) for k, v in g.model.state_dict().items())


def _first(workload, epoch: int = 0, start: int = 0):
    return next(iter(workload.batches(epoch, start)))


@pytest.mark.parametrize("name", ["gpt", "cnn"])
def test_batches_are_fixed_by_seed_epoch_and_rank(name, request):
    config = request.getfixturevalue(name)
    x, y = _first(build(config, 0, 2, seed=3), epoch=2)
    x2, y2 = _first(build(config, 0, 2, seed=3), epoch=2)
    assert torch.equal(x, x2) and torch.equal(y, y2)  # a fresh build: the same batch
    assert len(y) == config.batch_size
    assert not torch.equal(x, _first(build(config, 1, 2, seed=3), epoch=2)[0])  # the other rank
    assert not torch.equal(x, _first(build(config, 0, 2, seed=3), epoch=3)[0])  # the next epoch
    assert not torch.equal(x, _first(build(config, 0, 2, seed=4), epoch=2)[0])  # another seed
    # resuming mid-epoch gives the tail of the same epoch
    full = list(build(config, 1, 2, seed=3).batches(1, 0))
    tail = list(build(config, 1, 2, seed=3).batches(1, 47))
    assert len(full) == config.steps_per_epoch == 50 and len(tail) == 3
    assert all(torch.equal(a[0], b[0]) for a, b in zip(full[47:], tail, strict=True))


@pytest.mark.parametrize("name", ["gpt", "cnn"])
def test_evaluation_is_deterministic_and_training_lowers_the_loss(name, request):
    config = request.getfixturevalue(name)
    if name == "cnn":  # a quarter of its validation set: evaluation runs four times here, and
        # the gain it must show (accuracy 0.10 -> 0.68, bound +0.2) dwarfs the noise of 500 images
        config = config.model_copy(update={"eval_examples": 500})
    torch.set_num_threads(1)
    workload = build(config, 0, 1, seed=0)
    model = workload.model
    first = workload.evaluate(model)
    assert workload.evaluate(model) == first  # the same validation set, no RNG
    assert build(config, 1, 2, seed=0).evaluate(model) == first  # on any rank, from any build
    assert model.training  # evaluation restores the mode
    optimizer, _ = optimizer_for(config, model, total_steps=1000)
    batches = workload.batches(0, 0)
    fixed = _first(workload)
    with torch.no_grad():
        before = float(workload.loss(model(fixed[0]), fixed[1]))
    for _ in range(12):
        x, y = next(batches)
        optimizer.zero_grad()
        workload.loss(model(x), y).backward()
        optimizer.step()
    with torch.no_grad():
        after = float(workload.loss(model(fixed[0]), fixed[1]))
    evaluated = workload.evaluate(model)
    print(f"{name}: batch loss {before:.3f} -> {after:.3f}, eval {first:.4f} -> {evaluated:.4f}")
    assert after < 0.9 * before
    assert evaluated < first - 0.2 if workload.lower_is_better else evaluated > first + 0.2


def test_old_configs_keep_their_models():
    assert build(_config("fashion_mnist"), 0, 2, seed=0).parameters == 421_642  # models.fashion_cnn
    assert build(_config("digits"), 0, 2, seed=0).parameters == 301_066  # models.mlp(hidden=512)


def test_a_model_must_belong_to_its_workload():
    with pytest.raises(ConfigError, match=r"^workload.model: digits has the models 'mlp', got 'bn_cnn'$"):
        load_config(None, ["workload.model=bn_cnn"])
    with pytest.raises(ConfigError, match=r"^workload.model_heads: 3 must divide model_width \(256\)$"):
        load_config(None, ["workload.name=kjv", "workload.model_width=256", "workload.model_heads=3"])


# --- a user workload by entry point -----------------------------------------------------------
ENTRYPOINT = "tests.test_workloads:tiny_workload"


def tiny_workload(config: WorkloadSection, rank: int, world_size: int, seed: int) -> Workload:
    """A user's own workload: a linear classifier on synthetic blobs, as an entry point."""
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 2)
    data = torch.Generator().manual_seed(seed)
    x = torch.randn(256, 4, generator=data)
    y = (x[:, 0] + x[:, 1] > 0).long()

    def batches(epoch: int, start: int):
        order = torch.randperm(256, generator=torch.Generator().manual_seed(seed * 1000 + epoch))
        for step in range(start, 8):
            idx = order[step * 32:(step + 1) * 32][rank::world_size]
            yield x[idx], y[idx]

    return Workload(model, torch.nn.functional.cross_entropy, 8, batches,
                    lambda m: float((m(x).argmax(1) == y).float().mean()), "accuracy")


NOT_CALLABLE = 42


def test_entrypoint_workload_builds_and_trains_a_step():
    config = load_config(None, [f"workload.entrypoint={ENTRYPOINT}", "workload.lr=0.5"])
    workload = build(config.workload, 0, 2, seed=0)
    assert isinstance(workload.model, torch.nn.Linear) and workload.steps_per_epoch == 8
    assert metric_of(config.workload) == "accuracy"
    optimizer, scheduler = optimizer_for(config.workload, workload.model, total_steps=8)
    x, y = _first(workload)
    loss = workload.loss(workload.model(x), y)
    loss.backward()
    optimizer.step()
    with torch.no_grad():
        assert float(workload.loss(workload.model(x), y)) < float(loss)
    assert 0 <= workload.evaluate(workload.model) <= 1


@pytest.mark.parametrize(("path", "message"), [
    ("tests.test_workloads", r"expected 'package.module:function', got 'tests.test_workloads'"),
    ("tests/test_workloads.py:tiny_workload", r"expected 'package.module:function'"),
    ("no_such_package.mod:build", r"cannot import 'no_such_package.mod' \(No module named 'no_such_package'\)"),
    ("tests.test_workloads:missing", r"module 'tests.test_workloads' has no 'missing'"),
    ("tests.test_workloads:NOT_CALLABLE", r"'tests.test_workloads:NOT_CALLABLE' is not callable"),
])
def test_bad_entrypoint_is_one_line_naming_the_key(path, message):
    with pytest.raises(ConfigError, match=rf"^workload.entrypoint: {message}") as error:
        load_config(None, [f"workload.entrypoint={path}"])
    assert "\n" not in str(error.value)


def test_entrypoint_must_return_a_workload():
    config = load_config(None, ["workload.entrypoint=tests.test_workloads:_not_a_workload"]).workload
    with pytest.raises(TypeError, match="returned dict, not a jobs.workloads.Workload"):
        build(config, 0, 1, seed=0)


def _not_a_workload(config, rank, world_size, seed):
    return {}


def test_a_warm_up_rises_linearly_to_the_peak_then_the_cosine_decays_to_zero():
    """``lr_warmup_steps``: lr/N at the first step, lr at step N-1, then the cosine over the
    remaining steps, 0 after the last; without it the schedule is torch's own cosine."""
    model = torch.nn.Linear(4, 2)
    config = WorkloadSection(optimizer="adamw", lr=0.01, lr_schedule="cosine", lr_warmup_steps=10)
    opt, scheduler = optimizer_for(config, model, total_steps=110)
    lrs = []
    for _ in range(110):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        scheduler.step()
    assert lrs[0] == pytest.approx(0.001) and lrs[9] == pytest.approx(0.01)
    assert all(a < b for a, b in zip(lrs[:9], lrs[1:10], strict=True))  # rising through the warm-up
    assert all(a > b for a, b in zip(lrs[10:-1], lrs[11:], strict=True))  # then decaying
    assert lrs[60] == pytest.approx(0.005) and opt.param_groups[0]["lr"] == pytest.approx(0.0, abs=1e-12)
    constant, after = optimizer_for(WorkloadSection(lr=0.1, lr_schedule="constant", lr_warmup_steps=4), model, 50)
    assert after.get_last_lr() == [pytest.approx(0.025)]
    plain = optimizer_for(WorkloadSection(optimizer="adamw", lr=0.01), model, 100)[1]
    assert isinstance(plain, torch.optim.lr_scheduler.CosineAnnealingLR)


def test_the_language_model_benchmark_config_is_the_transformer_at_width_128(kjv_cached):
    """``lm_kjv.yaml``: the shipped transformer's shape at width 128 (its comment's size), 768
    tokens per worker per step, 2,000 steps after a 100-step warm-up."""
    lm = _config("lm_kjv")
    built = build(lm, 0, 2, seed=0)
    assert 780_000 < built.parameters < 860_000 and built.metric == "loss"
    assert (lm.batch_size * lm.block, lm.steps_per_epoch * lm.epochs, lm.lr_warmup_steps) == (768, 2000, 100)
    assert lm.optimizer == "adamw" and lm.lr_schedule == "cosine"

