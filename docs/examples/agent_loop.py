"""An agent loop against `radixkv serve` with the official `openai` client: the model calls a real local tool
(`read_file`), the loop runs it and sends the result back, until the model answers without a call.

    radixkv serve smollm2-135m --port 8000 &
    python docs/examples/agent_loop.py --base-url http://127.0.0.1:8000/v1

Every round sends the whole conversation again, under one `prompt_cache_key` (the session): its prefix
is in the prefix cache, and `usage.prompt_tokens_details.cached_tokens` says how much of it was read there.
The first round uses `tool_choice="required"` (constrained decoding: even a 135M model makes a valid call).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from openai import OpenAI

ROOT = Path.cwd()
FILES = sorted(p.name for p in ROOT.iterdir() if p.is_file())[:20]  # the schema names them: a call names one
TOOLS = [{"type": "function", "function": {
    "name": "read_file", "description": "Read a text file of the current directory",
    "parameters": {"type": "object", "properties": {"path": {"type": "string", "enum": FILES}},
                   "required": ["path"]}}}]


def read_file(path: str) -> str:
    """The tool: a file under the current directory, its first 1,000 characters (an error is a result too)."""
    target = (ROOT / path).resolve()
    if not target.is_relative_to(ROOT) or not target.is_file():
        return f"error: no file {path!r} here; files: {', '.join(FILES)}"
    return target.read_text(errors="replace")[:1000]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--rounds", type=int, default=4)
    args = p.parse_args()
    client = OpenAI(base_url=args.base_url, api_key="unused")
    messages = [{"role": "system", "content": "You answer questions about local files. Use the tools."},
                {"role": "user", "content": "What does README.md say? Read it, then answer in one sentence."}]
    for round in range(args.rounds):
        out = client.chat.completions.create(
            model=args.model, messages=messages, tools=TOOLS, tool_choice="required" if round == 0 else "auto",
            max_tokens=64, temperature=0, prompt_cache_key="agent-loop-demo")
        usage, message = out.usage, out.choices[0].message
        print(f"round {round}: {usage.prompt_tokens} prompt tokens, {usage.prompt_tokens_details.cached_tokens} "
              f"cached, {usage.completion_tokens} generated, finish_reason={out.choices[0].finish_reason}")
        messages.append(message.model_dump(include={"role", "content", "tool_calls"}, exclude_none=True))
        if not message.tool_calls:
            print(f"answer: {message.content}")
            return
        for call in message.tool_calls:
            result = read_file(str(json.loads(call.function.arguments).get("path", "")))
            print(f"  {call.function.name}({call.function.arguments}) -> {len(result)} characters")
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    print("no answer within the rounds")


if __name__ == "__main__":
    main()
