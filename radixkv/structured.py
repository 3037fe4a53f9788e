"""Constrained decoding: outputs that follow a JSON schema, token by token (xgrammar, as vLLM and SGLang use).

``SamplingParams(structured=StructuredOutput(json_schema=...))`` makes every sampled token one the schema
allows, so the answer parses and validates whatever the model: ``tool_choice: "required"`` or a named
function (a call object whose ``arguments`` follow the function's schema) and ``response_format`` rest on
it. The engine keeps one ``GrammarMatcher`` per constrained request (``Grammars``): before sampling, the
tokens the grammar forbids are masked to -inf in that request's logits row; after, the token is accepted;
the request finishes when the grammar is complete (its stop token accepted). A schema xgrammar cannot compile
is a ``ValueError`` when the request is added, never a failure inside a batch.

xgrammar is imported when a constrained request first comes (``import radixkv`` never needs it). JSON is
compact (no free whitespace): a small model allowed any whitespace can fill its tokens with it. Compiled
grammars are cached by schema (xgrammar's own cache). O(vocabulary / 32) per constrained token for the mask.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StructuredOutput:
    """What a constrained answer must be: JSON following ``json_schema`` (the schema as JSON text), or any
    JSON object (``json_object``), exactly one of them, between the literal texts ``begin`` and ``end``
    (``"<tool_call>\\n"`` and ``"\\n</tool_call>"``: a forced call in the form the ``hermes`` parser reads,
    the form its next turn renders it in, so that turn's prompt extends this one's cached tokens)."""

    json_schema: str | None = None
    json_object: bool = False
    begin: str = ""
    end: str = ""

    def __post_init__(self) -> None:
        if (self.json_schema is None) == (not self.json_object):
            raise ValueError("StructuredOutput takes exactly one of json_schema or json_object=True")
        if self.json_schema is not None:
            if not isinstance(self.json_schema, str):
                raise ValueError("StructuredOutput.json_schema is the schema as JSON text")
            check_schema(self.json_schema)


def check_schema(schema: str | dict) -> None:
    """``ValueError`` with xgrammar's reason where it cannot compile ``schema`` (JSON text or a dict)."""
    xgr = _xgrammar()
    text = schema if isinstance(schema, str) else json.dumps(schema)
    try:
        json.loads(text)
        xgr.Grammar.from_json_schema(text, any_whitespace=False)
    except (ValueError, RuntimeError, TypeError) as e:
        reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        raise ValueError(f"the JSON schema cannot be used for constrained decoding: {reason}") from None


def _xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError as e:  # a dependency of radixkv: only a broken install lacks it
        raise ValueError(f"constrained decoding needs xgrammar (pip install xgrammar): {e}") from None
    return xgrammar


class Grammars:
    """One engine's grammar compiler and its constrained requests' matchers.

    ``tokenizer``: the model's Hugging Face tokenizer; ``vocab_size``: the logits' width (the model's)."""

    def __init__(self, tokenizer: Any, vocab_size: int):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self._compiler: Any = None

    def warm(self) -> None:
        """Import xgrammar and build the compiler now (2-3 s on a CPU), where a server starts, so the first
        constrained request does not stall the others; nothing for a model without a tokenizer."""
        if self.tokenizer is not None:
            self._compiler_ready()

    def _compiler_ready(self) -> Any:
        xgr = _xgrammar()
        if self._compiler is None:
            if self.tokenizer is None:
                raise ValueError("constrained decoding needs the model's tokenizer")
            info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        return xgr

    def matcher(self, spec: StructuredOutput) -> Any:
        """A fresh matcher for ``spec`` (``ValueError`` where the model has no tokenizer or it does not compile)."""
        xgr = self._compiler_ready()
        try:
            body = xgr.Grammar.from_json_schema('{"type": "object"}' if spec.json_object else spec.json_schema,
                                                any_whitespace=False)
            parts = [xgr.Grammar.from_ebnf(f"root ::= {json.dumps(text)}") for text in (spec.begin, spec.end)]
            grammar = xgr.Grammar.concat(*[g for g, text in zip((parts[0], body, parts[1]),
                                                                 (spec.begin, "json", spec.end), strict=True) if text])
            compiled = self._compiler.compile_grammar(grammar)
        except RuntimeError as e:
            raise ValueError(f"the JSON schema cannot be used for constrained decoding: {e}") from None
        return xgr.GrammarMatcher(compiled)

    def mask(self, logits: Any, matchers: list[Any]) -> None:
        """Set to -inf, in place, what each row's matcher forbids next (None: an unconstrained row).
        ``logits``: [rows, vocab_size], float."""
        rows = [i for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return
        xgr = _xgrammar()
        bitmask = xgr.allocate_token_bitmask(len(matchers), self.vocab_size)
        for i in rows:
            matchers[i].fill_next_token_bitmask(bitmask, i)
        # xgrammar's own kernel: portable C++ on a CPU, any float dtype, only the constrained rows
        xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), vocab_size=self.vocab_size, indices=rows)
        if logits.shape[1] > self.vocab_size:  # padded logits past the vocabulary are never allowed
            logits[rows, self.vocab_size:] = float("-inf")
