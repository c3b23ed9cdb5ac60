"""V0 value model: context buffer, kernel and TabPFN heads, residual query adapter, MiniLM backbone."""

import types

import pytest
import torch

from lit_rlvr.value import (
    ContextBuffer,
    EmbeddingBackbone,
    KernelHead,
    PolicyHiddenStates,
    ResidualQueryAdapter,
    TabPFNHead,
    ValueModel,
    load_adapter,
    save_adapter,
)


def auc(score: torch.Tensor, label: torch.Tensor) -> float:
    pos, neg = score[label], score[~label]
    greater = (pos[:, None] > neg[None]).float().mean()
    ties = (pos[:, None] == neg[None]).float().mean()
    return float(greater + 0.5 * ties)


def binomial_context(m: int, p: torch.Tensor, g: torch.Generator, n: int = 4):
    counts = torch.full((m,), n)  # [m]
    return torch.binomial(counts.float(), p, generator=g) / n, counts


# ----------------------------------------------------------------------------------------------- buffer


def test_context_buffer_ring_ready_and_state():
    buf = ContextBuffer(capacity=4, min_context=3)
    assert len(buf) == 0 and not buf.is_ready
    buf.add(["a", "b"], torch.tensor([0.25, 1.0]), torch.tensor([4, 4]))
    buf.add(["c", "skip"], [0.5, 0.0], [2, 0])  # n = 0 carries no information
    assert buf.prompts == ["a", "b", "c"] and buf.is_ready
    buf.add(["d", "e"], [0.0, 0.75], [4, 4])  # capacity 4: "a" drops out
    assert buf.prompts == ["b", "c", "d", "e"]
    torch.testing.assert_close(buf.success_rate, torch.tensor([1.0, 0.5, 0.0, 0.75]))
    assert buf.counts.tolist() == [4, 2, 4, 4] and buf.counts.dtype == torch.long
    other = ContextBuffer(capacity=4, min_context=3)
    other.load_state_dict(buf.state_dict())
    assert other.state_dict() == buf.state_dict()
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        buf.add(["x"], [1.5], [4])
    with pytest.raises(ValueError, match="min_context"):
        ContextBuffer(capacity=4, min_context=5)


# ----------------------------------------------------------------------------------------------- kernel head


def test_kernel_head_hand_worked():
    # context x = -1, +1 (already mean 0, std 1), y = 1, 0.5, n = 4, 4; α0 = 2
    # p̄ = (4·1 + 4·0.5 + 0.5) / (8 + 1) = 6.5/9 = 0.722222; median pairwise distance 2, scale 0.5 → h = 1
    # at x = -1: k(self) = 1, k(other) = exp(-2²/2) = exp(-2) = 0.135335
    #   p̂ = (2·0.722222 + 1·4·1 + 0.135335·4·0.5) / (2 + 4 + 0.135335·4) = 5.715115 / 6.541341 = 0.873692
    # at x = +1: (1.444444 + 0.135335·4·1 + 4·0.5) / 6.541341 = 3.985785 / 6.541341 = 0.609322
    # at x = 0: k = exp(-1/2) = 0.606531 to both: (1.444444 + 0.606531·(4 + 2)) / (2 + 0.606531·8) = 0.741892
    head = KernelHead(alpha0=2.0, bandwidth_scales=(0.5,))
    head.fit(torch.tensor([[-1.0], [1.0]]), torch.tensor([1.0, 0.5]), torch.tensor([4, 4]))
    assert float(head.bandwidth_) == pytest.approx(1.0)
    p = head.predict(torch.tensor([[-1.0], [1.0], [0.0]]))
    torch.testing.assert_close(p, torch.tensor([0.873692, 0.609322, 0.741892]), atol=1e-5, rtol=0)


def test_kernel_head_auc_when_success_depends_on_a_feature():
    g = torch.Generator().manual_seed(0)
    m, b, f = 256, 512, 8
    x = torch.randn(m + b, f, generator=g)  # [m+b, f]
    p = torch.sigmoid(3 * x[:, 0])  # [m+b] success depends on feature 0 only
    y, n = binomial_context(m, p[:m], g)
    p_hat = KernelHead().fit(x[:m], y, n).predict(x[m:])  # [b]
    assert p_hat.shape == (b,) and ((p_hat > 0) & (p_hat < 1)).all()
    outcome = torch.rand(b, generator=g) < p[m:]  # one fresh rollout per test prompt
    assert auc(p_hat, p[m:] > 0.5) > 0.9
    assert auc(p_hat, outcome) > 0.8
    # shuffled labels: no signal, AUC near chance
    y_shuffled = y[torch.randperm(m, generator=g)]
    assert abs(auc(KernelHead().fit(x[:m], y_shuffled, n).predict(x[m:]), outcome) - 0.5) < 0.1


def _held_out_loglik(head: KernelHead, x: torch.Tensor, p: torch.Tensor, h: torch.Tensor) -> float:
    head.bandwidth_ = h
    q = head.predict(x).double().clamp(1e-6, 1 - 1e-6)
    return float((p * q.log() + (1 - p) * (1 - q).log()).mean())  # expected log-lik of one rollout


@pytest.mark.parametrize("seed", range(3))
def test_kernel_head_loo_bandwidth_is_sensible(seed):
    g = torch.Generator().manual_seed(seed)
    m = 256
    x = torch.randn(m + 1500, 2, generator=g)  # [m + 1500, 2]
    smooth = torch.sigmoid(4 * x[:, 0])  # slow variation → wide kernel
    sharp = torch.where(torch.sin(6 * x[:, 0]) > 0, 0.95, 0.05)  # fast variation → narrow kernel
    flat = torch.full((m + 1500,), 0.5)  # no signal → as wide as possible
    picked = {}
    for name, p in (("smooth", smooth), ("sharp", sharp), ("flat", flat)):
        head = KernelHead().fit(x[:m], *binomial_context(m, p[:m], g))
        chosen = head.bandwidth_.clone()
        picked[name] = float(chosen / head.bandwidth_grid_[0])
        scores = [_held_out_loglik(head, x[m:], p[m:].double(), h) for h in head.bandwidth_grid_]
        # the LOO choice is close to the best bandwidth on fresh data
        assert _held_out_loglik(head, x[m:], p[m:].double(), chosen) >= max(scores) - 0.02, (name, scores)
    assert picked["sharp"] < picked["smooth"] < picked["flat"]



def test_kernel_head_search_in_batches_of_scales_gives_the_same_choice(monkeypatch):
    """A context too large for all scales' M×M kernels at once is searched a few scales at a time: same scores."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 3, generator=g)  # [64, 3]
    rates, counts = binomial_context(64, torch.sigmoid(3 * x[:, 0]), g)
    whole = KernelHead().fit(x, rates, counts)
    monkeypatch.setattr(KernelHead, "SEARCH_FLOATS", 5 * 64 * 64)  # 5 scales per batch: 12 scales in 3 batches
    batched = KernelHead().fit(x, rates, counts)
    torch.testing.assert_close(batched.loo_loglik_, whole.loo_loglik_, rtol=1e-6, atol=1e-6)
    assert batched.bandwidth_ == whole.bandwidth_


# ----------------------------------------------------------------------------------------------- TabPFN head


@pytest.fixture(scope="module")
def tiny_tabpfn_checkpoint(tmp_path_factory):
    """A small random-weight TabPFN v2.5 classifier checkpoint, built and saved with tabpfn's own functions."""
    from tabpfn.architectures import tabpfn_v2_5
    from tabpfn.constants import ModelVersion
    from tabpfn.inference_config import InferenceConfig
    from tabpfn.model_loading import save_tabpfn_model

    config, _ = tabpfn_v2_5.parse_config(
        dict(max_num_classes=10, emsize=32, nlayers=2, nhead=2, num_thinking_rows=4, features_per_group=3)
    )
    model = tabpfn_v2_5.get_architecture(config)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # random weights everywhere (the decoder starts at zero, which outputs 0.5 flat)
        for param in model.parameters():
            param.copy_(0.2 * torch.randn(param.shape, generator=g))
    inference = InferenceConfig.get_default("multiclass", ModelVersion.V2_5)
    # save_tabpfn_model reads a fitted estimator's models_/configs_/inference_config_; nothing else
    estimator = types.SimpleNamespace(models_=[model], configs_=[config], inference_config_=inference)
    path = tmp_path_factory.mktemp("tabpfn") / "tiny-classifier.ckpt"
    save_tabpfn_model(estimator, path)
    return path


def test_tabpfn_head_offline_random_checkpoint(tiny_tabpfn_checkpoint, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(80, 12, generator=g)  # [80, 12]
    y, n = binomial_context(64, torch.sigmoid(2 * x[:64, 0]), g)
    head = TabPFNHead(tiny_tabpfn_checkpoint, n_estimators=4)
    p = head.fit(x[:64], y, n).predict(x[64:])
    assert p.shape == (16,) and p.dtype == torch.float32
    assert ((p >= 0) & (p <= 1)).all() and p.std() > 0  # random weights, but not a constant
    again = TabPFNHead(tiny_tabpfn_checkpoint, n_estimators=4).fit(x[:64], y, n).predict(x[64:])
    assert torch.equal(p, again)  # deterministic
    # a single-class context cannot be fit by a classifier: the smoothed context rate instead
    ones = TabPFNHead(tiny_tabpfn_checkpoint).fit(x[:8], torch.ones(8), torch.full((8,), 4)).predict(x[64:])
    torch.testing.assert_close(ones, torch.full((16,), (32 + 0.5) / 33))


def test_tabpfn_head_path_errors(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="model_path"):
        TabPFNHead(tmp_path / "missing.ckpt")
    from tabpfn.settings import settings

    monkeypatch.setattr(settings.tabpfn, "model_cache_dir", tmp_path)  # an empty cache: nothing downloaded
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(RuntimeError, match="HF_HUB_OFFLINE"):
        TabPFNHead()


# ----------------------------------------------------------------------------------------------- adapter


def test_adapter_shapes_seed_and_mask():
    a = ResidualQueryAdapter(d_in=16, num_queries=10, width=6, heads=3, hidden=8, seed=3)
    assert a.num_features == 60
    torch.testing.assert_close(a.offset[2].weight, torch.zeros(60, 8))  # residual starts at zero
    same, other = ResidualQueryAdapter(16, 10, 6, 3, 8, seed=3), ResidualQueryAdapter(16, 10, 6, 3, 8, seed=4)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), same.parameters()))
    assert not torch.equal(a.queries, other.queries)
    g = torch.Generator().manual_seed(0)
    states = torch.randn(2, 5, 16, generator=g)  # [2, 5, 16]
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], dtype=torch.bool)
    out = a(states, mask)
    assert out.shape == (2, 60)
    junk = states.clone()
    junk[1, 3:] = 1e3  # padding must not leak into the features
    torch.testing.assert_close(a(junk, mask), out)
    torch.testing.assert_close(a(states[1:, :3], mask[1:, :3]), out[1:])
    with pytest.raises(ValueError, match="divisible"):
        ResidualQueryAdapter(16, width=5, heads=3)


def test_adapter_save_and_load(tmp_path):
    a = ResidualQueryAdapter(d_in=16, num_queries=4, width=6, heads=2, hidden=8, seed=1)
    with torch.no_grad():
        a.offset[2].weight.normal_()  # "trained" weights differ from any seeded init
    x, mask = torch.randn(3, 7, 16), torch.ones(3, 7, dtype=torch.bool)
    save_adapter(a, tmp_path / "adapter.pt")
    torch.testing.assert_close(load_adapter(tmp_path / "adapter.pt")(x, mask), a(x, mask))
    torch.save(a.state_dict(), tmp_path / "bare.pt")  # bare state dict: shapes give the config, heads given
    torch.testing.assert_close(load_adapter(tmp_path / "bare.pt", heads=2)(x, mask), a(x, mask))
    with pytest.raises(FileNotFoundError, match="adapter_path"):
        load_adapter(tmp_path / "missing.pt")


# ----------------------------------------------------------------------------------------------- backbone + model


@pytest.fixture(scope="module")
def minilm():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")  # must load from the packaged files, never the hub
        mp.setenv("TRANSFORMERS_OFFLINE", "1")
        yield EmbeddingBackbone("minilm", max_length=32)


def test_minilm_embeds_offline_and_caches(minilm, monkeypatch):
    states, mask = minilm(["3+4=", "a much longer prompt with several more tokens in it"])
    assert minilm.dim == 384 and states.shape[0] == 2 and states.shape[2] == 384
    assert mask.dtype == torch.bool and mask[0].sum() < mask[1].sum() and mask[1].all()
    assert torch.isfinite(states).all() and (states[0, ~mask[0]] == 0).all()
    fresh = minilm._embed(["3+4="])[0][0]  # uncached, alone
    torch.testing.assert_close(states[0, : mask[0].sum()], fresh, atol=1e-4, rtol=1e-4)
    embedded = minilm.num_embedded

    def boom(prompts):
        raise AssertionError(f"recomputed {prompts}")

    monkeypatch.setattr(minilm, "_embed", boom)  # a cache hit must not reach the model
    again, mask_again = minilm(["3+4=", "3+4="])
    assert minilm.num_embedded == embedded
    torch.testing.assert_close(again[0], again[1])
    torch.testing.assert_close(again[0, : mask[0].sum()], states[0, : mask[0].sum()])
    assert set(minilm.state_dict()["cached_prompts"]) >= {"3+4=", "a much longer prompt with several more tokens in it"}


def test_cache_is_bounded_and_policy_states_validate():
    calls = []

    def fake(prompts):
        calls.extend(prompts)
        lengths = torch.tensor([len(p) for p in prompts])
        mask = torch.arange(int(lengths.max()))[None] < lengths[:, None]  # [B, L]
        return torch.ones(len(prompts), mask.shape[1], 4) * lengths[:, None, None], mask

    bb = PolicyHiddenStates(fake, dim=4, cache=True, cache_size=2)
    bb(["bb", "a", "bb"])
    assert calls == ["bb", "a"]  # duplicates in one call embedded once; "bb" used last
    bb(["ccc"])  # evicts "a", the least recently used
    bb(["a"])
    assert calls == ["bb", "a", "ccc", "a"] and bb.state_dict()["cached_prompts"] == ["ccc", "a"]
    assert PolicyHiddenStates(fake, dim=4).cache_enabled is False  # the policy changes: no cache by default
    with pytest.raises(ValueError, match=r"\[B, L, 5\]"):
        PolicyHiddenStates(fake, dim=5)(["x"])


def _arith_prompts(n: int, g: torch.Generator) -> tuple[list[str], torch.Tensor]:
    """Sums of one-digit numbers are easy (p = 0.9), products of two-digit numbers hard (p = 0.15)."""
    prompts, p = [], []
    for i in range(n):
        if i % 2 == 0:
            a, b = torch.randint(0, 10, (2,), generator=g).tolist()
            prompts.append(f"{a}+{b}="), p.append(0.9)
        else:
            a, b = torch.randint(10, 100, (2,), generator=g).tolist()
            prompts.append(f"{a}*{b}="), p.append(0.15)
    return prompts, torch.tensor(p)


@pytest.mark.parametrize("features", ["pooled", "adapter"])
def test_value_model_predicts_in_context(minilm, features):
    g = torch.Generator().manual_seed(0)
    prompts, p = _arith_prompts(160, g)
    model = ValueModel(minilm, KernelHead(), features=features, seed=0)
    context = ContextBuffer(capacity=128, min_context=32)
    p_hat, metrics = model.predict(prompts[128:], context)
    assert p_hat is None and float(metrics["context_size"]) == 0
    y, n = binomial_context(128, p[:128], g)
    context.add(prompts[:128], y, n)
    p_hat, metrics = model.predict(prompts[128:], context)
    assert p_hat.shape == (32,) and ((p_hat >= 0) & (p_hat <= 1)).all()
    assert set(metrics) >= {"context_size", "p_hat_mean", "bandwidth"}
    assert auc(p_hat, p[128:] > 0.5) > 0.9
    width = 384 if features == "pooled" else 168 * 6
    assert model.features(prompts[:3]).shape == (3, width)


def test_value_model_feature_modes():
    def states(prompts):
        return torch.ones(len(prompts), 2, 8), torch.ones(len(prompts), 2, dtype=torch.bool)

    fake = PolicyHiddenStates(states, dim=8)
    assert ValueModel(fake, KernelHead()).features_mode == "pooled"  # auto, no trained adapter
    adapter = ResidualQueryAdapter(8, num_queries=4)
    assert ValueModel(fake, KernelHead(), adapter=adapter).features_mode == "adapter"
    with pytest.raises(ValueError, match="features"):
        ValueModel(fake, KernelHead(), features="cls")
    with pytest.raises(ValueError, match="head"):
        ValueModel.create(head="forest")


def test_value_model_create_with_saved_adapter(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    save_adapter(ResidualQueryAdapter(384, num_queries=4, width=6, heads=3, seed=5), tmp_path / "v0.pt")
    model = ValueModel.create(backbone="minilm", head="kernel", adapter_path=tmp_path / "v0.pt", max_length=16)
    assert model.features_mode == "adapter" and model.features(["1+1="]).shape == (1, 24)


def test_tabpfn_head_gets_the_value_models_device_and_seed(tiny_tabpfn_checkpoint, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = ValueModel.create(backbone="minilm", head="tabpfn", head_kwargs={"model_path": tiny_tabpfn_checkpoint},
                              device="cpu", seed=7, max_length=16)
    assert (model.head.device, model.head.random_state) == ("cpu", 7)
    kept = ValueModel.create(backbone="minilm", head="tabpfn", seed=7, max_length=16,
                             head_kwargs={"model_path": tiny_tabpfn_checkpoint, "random_state": 1})
    assert kept.head.random_state == 1  # head_kwargs win
