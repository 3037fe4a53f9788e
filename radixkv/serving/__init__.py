"""Online serving: ``AsyncLLM`` (the engine behind asyncio) and the OpenAI-compatible server (``build_app``;
``radixkv serve``). Needs the ``serve`` dependencies (FastAPI, uvicorn, prometheus-client)."""

from __future__ import annotations

from radixkv.serving.async_llm import AsyncLLM, Delta

__all__ = ["AsyncLLM", "Delta"]
