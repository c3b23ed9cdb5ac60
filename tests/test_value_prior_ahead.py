"""V0.5's per-step cost savings compute the same prior: features computed ahead equal the lazily computed ones,
the kernel bandwidth reused between searches gives the same p̂ on the same context, and the reused context
matrix equals a fresh stack."""

import pytest
import torch

from lit_rlvr.value.prefetch import Ahead, TrainPrompts
from lit_rlvr.data.datamodule import RLVRDataModule
from lit_rlvr.value import ContextBuffer, KernelHead, ValueModel
from lit_rlvr.value.backbone import EmbeddingBackbone, PolicyHiddenStates


@pytest.fixture(scope="module")
def minilm():
    return EmbeddingBackbone("minilm")


def arithmetic_prompts(n: int, seed: int = 0) -> list[str]:
    dm = RLVRDataModule(num_train=n, seed=seed)
    dm.setup()
    return [dm.train_set[i]["prompt"] for i in range(n)]


def toy_model(bandwidth_refit: float = 0.0, dim: int = 6) -> ValueModel:
    """A ValueModel over a deterministic toy backbone (token states from a hash of the text)."""

    def fn(prompts):
        rows = [torch.randn(3, dim, generator=torch.Generator().manual_seed(sum(map(ord, p)) * 31 + len(p)))
                for p in prompts]
        return torch.stack(rows), torch.ones(len(prompts), 3, dtype=torch.bool)

    return ValueModel(PolicyHiddenStates(fn, dim), KernelHead(), features="pooled", bandwidth_refit=bandwidth_refit)


def filled_context(prompts: list[str], capacity: int = 64) -> ContextBuffer:
    ctx = ContextBuffer(capacity=capacity, min_context=8)
    g = torch.Generator().manual_seed(1)
    ctx.add(prompts, torch.rand(len(prompts), generator=g), torch.full((len(prompts),), 4))
    return ctx


def test_precomputed_features_equal_the_lazy_ones(minilm):
    prompts = arithmetic_prompts(300)
    ahead = ValueModel(minilm, KernelHead())
    seconds = ahead.precompute(prompts, batch_size=128)
    assert seconds > 0 and ahead.num_precomputed == len(set(prompts))
    embedded = minilm.num_embedded
    step = prompts[17:25]
    x_ahead = ahead.prompt_features(step)  # [8, F] from the precomputed store: no backbone call
    assert minilm.num_embedded == embedded
    lazy = ValueModel(EmbeddingBackbone("minilm", cache=False), KernelHead())
    torch.testing.assert_close(x_ahead, lazy.prompt_features(step), atol=1e-6, rtol=0)  # same numbers


def test_bandwidth_reused_on_the_same_context_gives_the_same_prior():
    prompts = [f"{a}+{b}=" for a in range(8) for b in range(8)]
    every, reuse = toy_model(0.0), toy_model(0.25)
    ctx = filled_context(prompts[:48])
    new = prompts[48:56]
    p_every, _ = every.predict(new, ctx)
    p_first, m_first = reuse.predict(new, ctx)
    p_again, m_again = reuse.predict(new, ctx)  # nothing new in the context: no search, same p̂
    assert float(m_first["bandwidth_searched"]) == 1.0 and float(m_again["bandwidth_searched"]) == 0.0
    torch.testing.assert_close(p_every, p_first, atol=0, rtol=0)
    torch.testing.assert_close(p_every, p_again, atol=0, rtol=0)
    # a quarter of the context new: the schedule searches again, as every-step search always does
    g = torch.Generator().manual_seed(2)
    ctx.add(prompts[48:64], torch.rand(16, generator=g), torch.full((16,), 4))
    p_every, _ = every.predict(new, ctx)
    p_reuse, m = reuse.predict(new, ctx)
    assert float(m["bandwidth_searched"]) == 1.0
    torch.testing.assert_close(p_every, p_reuse, atol=0, rtol=0)


def test_head_state_round_trip_reuses_the_same_bandwidth():
    prompts = [f"{a}*{b}=" for a in range(8) for b in range(8)]
    model = toy_model(0.5)
    ctx = filled_context(prompts[:40])
    model.predict(prompts[40:48], ctx)  # searches
    ctx.add(prompts[40:48], torch.full((8,), 0.5), torch.full((8,), 4))
    state, ctx_state = model.head_state(), ctx.state_dict()
    p, m = model.predict(prompts[48:56], ctx)  # reuses
    assert float(m["bandwidth_searched"]) == 0.0
    fresh, fresh_ctx = toy_model(0.5), ContextBuffer(capacity=64, min_context=8)
    fresh.load_head_state(state)
    fresh_ctx.load_state_dict(ctx_state)
    assert fresh_ctx.total_added == ctx.total_added == 48
    p_fresh, m_fresh = fresh.predict(prompts[48:56], fresh_ctx)
    assert float(m_fresh["bandwidth_searched"]) == 0.0
    torch.testing.assert_close(p, p_fresh, atol=0, rtol=0)


def test_reused_context_matrix_equals_a_fresh_stack():
    prompts = [f"{a}-{b}=" for a in range(10) for b in range(10)]
    model = toy_model()
    ctx = ContextBuffer(capacity=32, min_context=8)
    for start in range(0, 96, 8):  # the ring fills, then drops its oldest records
        ctx.add(prompts[start:start + 8], torch.full((8,), 0.5), torch.full((8,), 4))
        x = model.prompt_features(ctx.prompts).double()  # [M, F]
        assert torch.equal(x, model.prompt_features(ctx.prompts).double())


def test_next_chunks_hold_the_prompts_of_the_coming_batches():
    dm = RLVRDataModule(num_train=200, batch_size=4, seed=3)
    dm.setup()
    loader = dm.train_dataloader()
    source = TrainPrompts(loader.dataset, loader.batch_size, str, loader.sampler)
    ahead = Ahead(source, steps=5)
    batches = [b["prompt"] for _, b in zip(range(12), loader)]
    chunk = None
    for i, batch in enumerate(batches):
        chunk = ahead.chunk_for(0, i) or chunk
        assert set(batch) <= set(chunk) and len(chunk) == 20
    assert ahead.chunk_for(0, 11) is None  # held already


@pytest.mark.parametrize("dim", [6, 384])
def test_incremental_standardized_columns_give_a_fresh_builds_bits(dim):
    """Between searches the kernel head's context columns are kept and only the new records' standardized: at
    every step, over ring wrap-arounds, the columns and p̂ are bit for bit those of a model built fresh from the
    checkpointed state (a resume)."""
    prompts = [f"{a}/{b}=" for a in range(30) for b in range(10)]
    model = toy_model(1.0, dim=dim)
    ctx = ContextBuffer(capacity=32, min_context=8)
    g = torch.Generator().manual_seed(3)
    searched = []
    for start in range(0, 280, 8):  # 35 steps: the ring wraps, the window reaches its buffer's end
        ctx.add(prompts[start:start + 8], torch.rand(8, generator=g), torch.randint(1, 9, (8,), generator=g))
        if not ctx.is_ready:
            continue
        new = prompts[start + 8:start + 16]
        fresh = toy_model(1.0, dim=dim)
        fresh.load_head_state(model.head_state())
        p, m = model.predict(new, ctx)
        p_fresh, m_fresh = fresh.predict(new, ctx)
        searched.append(float(m["bandwidth_searched"]))
        assert m_fresh["bandwidth_searched"] == m["bandwidth_searched"]
        assert torch.equal(p, p_fresh)
        z, sq_norm = model.head.standardize(model.prompt_features(ctx.prompts))  # [M, F], [M] from scratch
        assert torch.equal(model.head.zt_, z.T) and torch.equal(model.head.sq_norm_, sq_norm)
    assert 0 < sum(searched) < len(searched) / 2  # mostly steps that reuse the held columns


def test_sliding_columns_hold_the_records_columns_and_give_a_copys_matmul_bits():
    """`SlidingColumns` through drops, appends and moves back to its buffers' start holds what a fresh stack of
    the records' columns holds, and a matmul over its window view has the bits of a fresh `SlidingColumns` of
    those columns (what makes the kept columns' p̂ equal a rebuilt one's: a resume builds them afresh)."""
    from lit_rlvr.value.head_cache import SlidingColumns

    g = torch.Generator().manual_seed(5)
    records = [torch.randn(384, dtype=torch.float64, generator=g) for _ in range(40)]  # record i's column
    columns, first, moved = SlidingColumns((torch.stack(records, 1),), capacity=40), 0, 0
    for step in range(60):
        k = step % 9 + 1
        new = [torch.randn(384, dtype=torch.float64, generator=g) for _ in range(k)]
        records += new
        columns.drop(k)
        first += k
        moved += columns.end + k > columns.buffers[0].shape[1]
        columns.append((torch.stack(new, 1),))
        (view,) = columns.views()  # [F, 40]
        expected = torch.stack(records[first:], 1)  # [F, 40]
        assert torch.equal(view, expected)
        z = torch.randn(8, 384, dtype=torch.float64, generator=g)
        bias = torch.randn(40, dtype=torch.float64, generator=g)
        # the same layout as the window (strides, buffer width): the same BLAS kernel, so the same bits; a
        # contiguous copy (another leading dimension) may take another kernel, equal only to rounding
        (rebuilt,) = SlidingColumns((expected,), capacity=40).views()  # [F, 40], the window at its buffer's start
        assert rebuilt.stride() == view.stride()
        assert torch.equal(torch.addmm(bias, z, view, beta=-1, alpha=2), torch.addmm(bias, z, rebuilt, beta=-1,
                                                                                     alpha=2))
    assert moved >= 2


def test_context_columns_kept_up_to_date_equal_a_fresh_build():
    """ContextBuffer appends the new records' rows to its built columns: the same as building them anew,
    through the ring's wrap-around, zero-count records (skipped) and more records than the capacity at once."""
    ctx = ContextBuffer(capacity=16, min_context=1)
    g = torch.Generator().manual_seed(4)
    for step, size in enumerate([5, 7, 8, 3, 20, 8, 1, 9]):
        ctx.prompts  # build the columns, so the next add extends them
        counts = torch.randint(0, 5, (size,), generator=g)
        ctx.add([f"q{step}.{i}" for i in range(size)], torch.rand(size, generator=g).numpy(), counts.numpy())
        fresh = ContextBuffer(capacity=16, min_context=1)
        fresh.load_state_dict(ctx.state_dict())
        assert ctx.prompts == fresh.prompts
        assert torch.equal(ctx.success_rate, fresh.success_rate) and torch.equal(ctx.counts, fresh.counts)
