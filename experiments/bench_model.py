"""Our Llama forward against transformers' on the same weights, on the CPU.

``python -m experiments.bench_model`` times prefill of 512 / 1,024 / 2,048
tokens and one decode step (after a 1,024-token context) in float32 and
bfloat16, for radixkv's model (paged pool, reference attention, 16-bit
weights packed as the engine serves them) and for
``transformers``' forward, as medians of ``--repeats`` runs and their ratio.
It also times the prefill of a 128-token suffix after a cached 1,024-token
prefix against a full 1,152-token prefill: what prefix caching saves.
Writes ``results/bench_model.json`` with the full configuration.
"""

from __future__ import annotations

import copy
import json

import numpy as np
import torch
from tqdm import tqdm

from experiments.common import environment, parser, run_cli, with_ext
from radixkv import SlotAllocator
from radixkv.attention import AttentionBatch, TorchReferenceBackend
from radixkv.cpu.linear import pack_linears
from radixkv.memory.kv_pool import KVPool
from radixkv.model import load_model
from radixkv.model.step import run_step
from radixkv.timing import timed


class Ours:
    """Our model with a fresh pool per measurement (prefill) or a prepared context (decode)."""

    def __init__(self, model, slots: int):
        cfg = model.config
        self.model = model
        self.pool = KVPool(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, num_slots=slots,
                           dtype=next(model.parameters()).dtype)
        self.backend = TorchReferenceBackend(self.pool, cfg.num_heads)
        self.slots = SlotAllocator(slots).alloc(slots)

    def prefill(self, tokens: list[int], prefix: int = 0) -> None:
        n = len(tokens)
        run_step(self.model, self.pool, self.backend, [tokens[prefix:]],
                 AttentionBatch([prefix], [n - prefix], [self.slots[:n]]))

    def decode(self, context: int, token: int) -> None:
        run_step(self.model, self.pool, self.backend, [[token]],
                 AttentionBatch([context], [1], [self.slots[: context + 1]]))


def bench_dtype(loaded, dtype: torch.dtype, lengths: list[int], repeats: int, rng) -> list[dict]:
    model = copy.deepcopy(loaded.model).to(dtype)
    pack_linears(model)  # as the engine's CPU path serves 16-bit weights (a no-op in float32)
    hf = loaded.hf_model.to(dtype)
    vocab = model.config.vocab_size
    ours = Ours(model, max(*lengths, 1152) + 256)
    rows = []
    for n in lengths:
        toks = rng.integers(3, vocab, n).tolist()
        t_ours = timed(lambda: ours.prefill(toks), repeats)  # noqa: B023
        with torch.inference_mode():
            t_hf = timed(lambda: hf(torch.tensor([toks]), use_cache=False), repeats)  # noqa: B023
        rows.append({"op": f"prefill {n}", "dtype": str(dtype), "ours_s": t_ours, "transformers_s": t_hf})
    ctx = 1024
    toks = rng.integers(3, vocab, ctx + 1).tolist()
    ours.prefill(toks[:ctx])
    t_ours = timed(lambda: ours.decode(ctx, toks[ctx]), repeats * 4)
    with torch.inference_mode():
        past = hf(torch.tensor([toks[:ctx]]), use_cache=True).past_key_values

        def hf_decode():
            # one step on a copy-free cache: crop back afterwards so every repeat sees the same context
            hf(torch.tensor([[toks[ctx]]]), past_key_values=past, use_cache=True)
            past.crop(-1)

        t_hf = timed(hf_decode, repeats * 4)
    rows.append({"op": f"decode @{ctx}", "dtype": str(dtype), "ours_s": t_ours, "transformers_s": t_hf})
    suffix = rng.integers(3, vocab, 1152).tolist()
    ours.prefill(suffix[:1024])
    rows.append({"op": "suffix 128 after cached 1024", "dtype": str(dtype),
                 "ours_s": timed(lambda: ours.prefill(suffix, prefix=1024), repeats),
                 "full_1152_s": timed(lambda: ours.prefill(suffix), repeats)})
    for r in rows:
        if "transformers_s" in r:
            r["ratio_ours_over_transformers"] = r["ours_s"] / r["transformers_s"]
        else:
            r["speedup_vs_full"] = r["full_1152_s"] / r["ours_s"]
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    p = parser(__doc__.splitlines()[0], "results/bench_model")
    p.add_argument("--model", default="smollm2-135m", help="a built-in name, a HF directory or a .gguf file")
    p.add_argument("--lengths", default="512,1024,2048", help="comma-separated prompt lengths (tokens)")
    p.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated dtypes: float32, bfloat16, float16")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per figure (medians)")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(args.seed)
    loaded = load_model(args.model, keep_hf=True)
    rows = []
    for name in tqdm(args.dtypes.split(","), desc="dtypes"):
        rows += bench_dtype(loaded, getattr(torch, name), [int(x) for x in args.lengths.split(",")],
                            args.repeats, rng)
    for r in rows:
        extra = (f"transformers {r['transformers_s'] * 1e3:8.1f} ms  ratio {r['ratio_ours_over_transformers']:.2f}x"
                 if "transformers_s" in r else
                 f"full 1152 {r['full_1152_s'] * 1e3:8.1f} ms  speedup {r['speedup_vs_full']:.2f}x")
        print(f"{r['dtype']:15s} {r['op']:30s} ours {r['ours_s'] * 1e3:8.1f} ms  {extra}")
    out = with_ext(args.out, ".json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"config": vars(args), "env": environment(), "rows": rows}, indent=2))
    print("wrote", out)
    return rows


if __name__ == "__main__":
    run_cli(main)
