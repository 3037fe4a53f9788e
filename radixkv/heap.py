"""The garbage collector in a long-lived serving process."""

from __future__ import annotations

import gc


def freeze_startup_heap() -> None:
    """Leave what a server process built at start-up (the model, the tokenizer, the libraries: about 450k
    long-lived objects with SmolLM2) out of the garbage collector's full collections, which otherwise
    walk all of them every so often, on the engine's thread too: about 140 ms, a stall in the middle of
    serving (vLLM and SGLang freeze their start-up heap the same way). It is process-wide, so the server's
    entry points call it once their engine is built (``radixkv serve``, each Ray replica), never ``LLM``:
    an offline process that builds engine after engine must still collect the ones it dropped."""
    gc.collect()
    gc.freeze()
