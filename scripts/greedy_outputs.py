"""Greedy token ids of a fixed mixed batch, as JSON: to compare two builds' outputs bit for bit on one path.

Run it once per build and path, then compare the files, e.g. an older checkout against this one:
    PYTHONPATH=OLD_CHECKOUT python scripts/greedy_outputs.py --dtype auto > old.json
    python scripts/greedy_outputs.py --dtype auto > new.json && cmp old.json new.json
The batch mixes a shared prefix, long prompts (chunked prefill), a fully cached prompt and decode at batch 8.
"""

from __future__ import annotations

import argparse
import json
import random

from radixkv import LLM, SamplingParams


def prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, vocab) for _ in range(300)]
    out = [shared + [rng.randrange(3, vocab) for _ in range(rng.randrange(5, 400))] for _ in range(7)]
    return out + [[rng.randrange(3, vocab) for _ in range(1100)]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batch-invariant", action="store_true")
    args = ap.parse_args()
    llm = LLM(args.model, dtype=args.dtype, batch_invariant=args.batch_invariant, kv_cache_tokens=16384)
    batch = prompts(llm.model.config.vocab_size)
    params = SamplingParams(max_new_tokens=32, ignore_eos=True)
    first = [o.token_ids for o in llm.generate(batch, params)]
    again = [o.token_ids for o in llm.generate(batch[:3], params)]  # cached prefixes, one token computed each
    print(json.dumps({"dtype": llm.config.dtype, "batch": first, "cached": again}))


if __name__ == "__main__":
    main()
