"""``radixkv serve MODEL [options]``: the OpenAI-compatible server (``python -m radixkv.serve MODEL`` too).

    radixkv serve smollm2-135m --prefix-cache radix --port 8000
    curl http://127.0.0.1:8000/v1/completions -d '{"prompt": "Hello", "max_tokens": 8}'

Every engine option maps to an ``EngineConfig`` field and is validated the same way (a bad value is one
line on stderr and exit status 2). ``--enable-prefix-caching`` / ``--no-enable-prefix-caching`` are
vLLM's spellings (the latter is ``--prefix-cache none``). It listens on 127.0.0.1 unless ``--host`` says
otherwise. SIGINT or SIGTERM: it stops accepting, aborts what is running, and exits 0.

``--replicas N`` (N > 1) serves N engines as Ray actors, each request sent to the one ``--router`` picks
(``radixkv.routing``; ``radixkv.serving.replicas``), on a Ray cluster started on this machine or joined
at ``--ray-address``; it needs Ray (``pip install 'radixkv[ray]'``). ``--replicas 1`` is the one
in-process engine.

``--record-steps PATH`` writes every engine step to PATH as JSON lines as the steps end (a header with the
engine's KV bytes per token and config, then one ``StepRecord`` a line: ``radixkv.step_file``), the data
``python -m experiments.cost_fit --steps PATH`` fits the simulator's ``CostModel`` to. One engine only: with
``--replicas N`` (N > 1) it is refused.
"""

from __future__ import annotations

import argparse
import json
import sys

from radixkv.cache.eviction import POLICIES as ONLINE_POLICIES
from radixkv.config import EngineConfig
from radixkv.heap import freeze_startup_heap
from radixkv.routing import ROUTERS as ROUTER_NAMES
from radixkv.settings import SettingsParser, add_flags, described
from radixkv.stack import StackConfig

ENGINE_SKIP = ("model", "prefix_cache", "record_steps")  # positional; given below
# beside vLLM's switch; the engine's calibration log: --record-steps PATH, a file


def parser() -> argparse.ArgumentParser:
    """The server's flags: the stack's and the engine's settings generated from their fields
    (``radixkv.settings``: a new field is a new flag), then the server's own."""
    p = SettingsParser(prog="radixkv serve", description=__doc__.splitlines()[0],
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter, classes=(StackConfig,))
    p.add_argument("model", help="a built-in name (smollm2-135m, tiny-random, ...), a HF directory or a .gguf file")
    add_flags(p, StackConfig, ("prefix_cache",))
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="vLLM's spelling: --no-enable-prefix-caching is --prefix-cache none")
    add_flags(p, StackConfig, skip=ENGINE_SKIP, choices={"eviction_policy": sorted(ONLINE_POLICIES)})  # an engine
    add_flags(p, EngineConfig, skip=ENGINE_SKIP)
    p.add_argument("--hicache-ratio", type=float, default=None,
                   help="host tier size as a multiple of the KV pool (SGLang's spelling; instead of "
                        "--host-kv-cache-tokens)")
    p.add_argument("--record-steps", metavar="PATH", default=None,
                   help="write every engine step to PATH as JSON lines, the data python -m experiments.cost_fit "
                        "--steps PATH fits the simulator's cost model to (one engine: not with --replicas N)")
    p.add_argument("--default-max-tokens", type=int, default=16, help="max_tokens when a request gives none")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 exposes it to the network)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (or Anthropic's "
                                                   "'x-api-key: KEY') on /v1/* and /flush_cache")
    p.add_argument("--served-model-name", default=None, help="the model name clients send (None: MODEL)")
    p.add_argument("--log-level", default="warning", choices=("critical", "error", "warning", "info", "debug"),
                   help="uvicorn's log level")
    p.add_argument("--replicas", type=int, default=1, help="engines behind a router, as Ray actors when > 1")
    p.add_argument("--router", default="affinity", choices=sorted(ROUTER_NAMES),
                   help="which replica serves a request (radixkv.routing)")
    p.add_argument("--router-params", type=json.loads, default=None,
                   help='the router\'s parameters as JSON, e.g. \'{"overlap_score_weight": 2}\' for kv_events')
    p.add_argument("--ray-address", default=None, help="join this Ray cluster (None: start one here)")
    p.add_argument("--cpus-per-replica", type=int, default=1, help="Ray CPUs and torch threads per replica")
    return p


def engine_settings(args: argparse.Namespace) -> dict:
    """The parsed stack and engine settings by field name (what ``LLM`` takes besides model and cache)."""
    names = [f.name for cls in (StackConfig, EngineConfig) for f in described(cls) if f.name not in ENGINE_SKIP]
    return {name: getattr(args, name) for name in names}


def build(args: argparse.Namespace):
    """The app and its engine for parsed arguments (``ValueError`` for a bad setting or model)."""
    from radixkv.engine import LLM
    from radixkv.serving.app import build_app
    from radixkv.serving.async_llm import AsyncLLM

    settings = engine_settings(args)
    if args.hicache_ratio is not None:
        settings["hicache_ratio"] = args.hicache_ratio
    if args.record_steps is not None and args.replicas != 1:  # N engines' steps in one file would mix
        raise ValueError(f"--record-steps records one engine's steps: run it with --replicas 1 (got "
                         f"--replicas {args.replicas})")
    if args.replicas != 1:
        engine = _cluster_engine(args, settings)
    else:
        engine = AsyncLLM(lambda: LLM(args.model, prefix_cache=args.prefix_cache,  # built on the engine's thread
                                      enable_prefix_caching=args.enable_prefix_caching,
                                      record_steps=args.record_steps is not None, **settings),
                          record_steps=args.record_steps)
    return build_app(engine, args.served_model_name or args.model, api_key=args.api_key,
                     default_max_tokens=args.default_max_tokens), engine


def _cluster_engine(args: argparse.Namespace, settings: dict):
    """``--replicas N``: a ``ClusterEngine`` (``ValueError`` for a bad count or router, before Ray starts)."""
    try:
        from radixkv.serving.replicas import ClusterEngine
    except ImportError as e:
        raise ValueError(str(e)) from None
    return ClusterEngine(args.model, args.replicas, args.router, address=args.ray_address,
                         router_params=args.router_params, num_cpus_per_replica=args.cpus_per_replica,
                         prefix_cache=args.prefix_cache, enable_prefix_caching=args.enable_prefix_caching, **settings)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    import uvicorn

    try:
        app, engine = build(args)
    except (ValueError, FileNotFoundError, OSError) as e:
        print(f"radixkv serve: {e}", file=sys.stderr)
        return 2
    freeze_startup_heap()

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:  # running streams end now, not at the graceful timeout
            engine.abort_all()
            super().handle_exit(sig, frame)
            # a requested stop ends with status 0: uvicorn (0.30+) would raise the signal again after shutdown
            getattr(self, "_captured_signals", []).clear()

    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=5)
    Server(config).run()
    return 0


def cli() -> None:
    """The ``radixkv`` console script: ``radixkv serve MODEL [options]``."""
    argv = sys.argv[1:]
    if not argv or argv[0] != "serve":
        print("usage: radixkv serve MODEL [options]   (radixkv serve --help)", file=sys.stderr)
        sys.exit(2)
    sys.exit(main(argv[1:]))


if __name__ == "__main__":
    sys.exit(main())
