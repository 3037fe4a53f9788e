"""A measured cost model: fit the simulator's ``CostModel`` on the main job's steps, predict another workload.

``python -m experiments.cost_fit`` serves the main job (``experiments.multiturn``'s ``--fit-preset``,
default ``peers``) through the engine with ``record_steps``, fits ``CostModel.fit`` to its steps, then
serves a workload of another shape (``--predict-preset``, default ``long-system``: a 2,000-token shared
instruction block) and sets the mean TTFT per turn the simulator predicts with the fitted model against
the measured one: the error is out of sample, since no step of that workload went into the fit. The fit's
own workload, simulated, gives the in-sample error beside it. Writes ``<out>.json`` (the fitted constants,
both tables, the largest out-of-sample error).

On a GPU (``--device cuda``: FlashInfer, decode under CUDA graphs) it measures a preset for that GPU
(``scripts/gpu_check.sh`` runs it); ``--quick`` (a small shape of each workload, for a CPU and
``tiny-random``) checks the path end to end in seconds.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from experiments.common import environment, parser, run_cli, table, with_ext
from experiments.multiturn import PRESETS, run_cache, simulate_cache
from experiments.multiturn import parse_args as multiturn_args
from radixkv.config import DTYPES
from radixkv.cost import TIME_CONSTANTS, CostModel

# --quick: each workload small, and of two shapes still (a longer shared prefix, shorter turns, for the other)
QUICK = {"fit": ["--sessions", "2", "--turns", "2", "--system-tokens", "32", "--user-tokens", "16",
                 "--max-new-tokens", "4"],
         "predict": ["--sessions", "2", "--turns", "2", "--system-tokens", "96", "--user-tokens", "8",
                     "--max-new-tokens", "3"]}


def per_turn(measured: list[dict], predicted: list[dict]) -> list[dict]:
    """Mean TTFT per turn, measured and predicted, and the relative error predicted / measured - 1. O(rows)."""
    def mean(rows: list[dict], turn: int) -> float:
        return float(np.mean([r["ttft"] for r in rows if r["turn"] == turn]))

    out = []
    for turn in sorted({r["turn"] for r in measured}):
        m, p = mean(measured, turn), mean(predicted, turn)
        out.append({"turn": turn + 1, "measured_s": m, "predicted_s": p, "error": p / m - 1})
    return out


def workload_args(args: argparse.Namespace, role: str) -> argparse.Namespace:
    """``experiments.multiturn``'s arguments for the workload to ``fit`` or to ``predict``, on this run's model
    and device."""
    return multiturn_args(["--preset", getattr(args, f"{role}_preset"), "--model", args.model, "--dtype", args.dtype,
                           "--device", args.device, "--attention-backend", args.attention_backend, "--seed",
                           str(args.seed), *(QUICK[role] if args.quick else [])])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = parser(__doc__.splitlines()[0], "results/cost_fit")
    p.add_argument("--model", default="smollm2-135m", help="a built-in name, a HF directory or a .gguf file")
    p.add_argument("--dtype", default="auto", choices=DTYPES, help="auto: the model's own (SmolLM2-135M: bfloat16)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--attention-backend", default="auto", help="the engine's attention_backend")
    p.add_argument("--cache", default="radix", help="the prefix cache both workloads are served with")
    p.add_argument("--fit-preset", default="peers", choices=sorted(PRESETS), help="the workload fitted on")
    p.add_argument("--predict-preset", default="long-system", choices=sorted(PRESETS),
                   help="the workload predicted (out of sample)")
    p.add_argument("--quick", action="store_true", help="a small shape of both workloads (a CPU check)")
    args = p.parse_args(argv)
    if args.fit_preset == args.predict_preset:
        p.error("--predict-preset must differ from --fit-preset: the error is out of sample")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    fit_args, predict_args = workload_args(args, "fit"), workload_args(args, "predict")
    fit_rows, _, llm = run_cache(args.cache, fit_args, record_steps=True)
    cost = CostModel.fit(llm.step_log)
    steps = len(llm.step_log)
    del llm  # its KV pool: the next engine takes the memory
    measured, _, _ = run_cache(args.cache, predict_args)
    out_of_sample = per_turn(measured, simulate_cache(args.cache, predict_args, cost)[0])
    in_sample = per_turn(fit_rows, simulate_cache(args.cache, fit_args, cost)[0])
    fitted = {k: float(getattr(cost, k)) for k in TIME_CONSTANTS}
    print(f"fitted on {steps} steps of {args.fit_preset!r}:", {k: f"{v:.3g}" for k, v in fitted.items()})
    formats = {c: ".3g" for c in ("measured_s", "predicted_s", "error")}
    for name, rows in ((f"out of sample: {args.predict_preset}", out_of_sample),
                       (f"in sample: {args.fit_preset}", in_sample)):
        print(name)
        print(table(rows, ["turn", "measured_s", "predicted_s", "error"], formats))
    worst = max(abs(r["error"]) for r in out_of_sample)
    print(f"largest out-of-sample TTFT error per turn: {worst:.1%}")
    result = {"config": vars(args), "env": environment(), "fitted": fitted, "fit_steps": steps,
              "out_of_sample": out_of_sample, "in_sample": in_sample, "max_abs_error_out_of_sample": worst}
    out = with_ext(args.out, ".json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print("wrote", out)
    return result


if __name__ == "__main__":
    run_cli(main)
