"""A measured cost model: fit the simulator's ``CostModel`` on the main job's steps, predict another workload;
or fit it on the steps a server recorded.

``python -m experiments.cost_fit`` serves the main job (``experiments.multiturn``'s ``--fit-preset``,
default ``peers``) through the engine with ``record_steps``, fits ``CostModel.fit`` to its steps, then
serves a workload of another shape (``--predict-preset``, default ``long-system``: a 2,000-token shared
instruction block) and sets the mean TTFT per turn the simulator predicts with the fitted model against
the measured one: the error is out of sample, since no step of that workload went into the fit. The fit's
own workload, simulated, gives the in-sample error beside it.

``python -m experiments.cost_fit --steps PATH [PATH ...]`` runs no engine: it fits the step files
``radixkv serve --record-steps PATH`` wrote while a client replayed load against it (``radixkv.step_file``;
several files must share one KV layout), time constants and, where the host or storage tier served loads,
their bandwidths, at the engine's KV bytes per token from the files' header. The workload flags are unused.

Either way it writes ``<out>.json`` with the whole fitted model under ``"cost"`` (every ``CostModel`` field),
which ``CostModel.load(path)`` reads (``--cost-model`` / ``--simulate`` options take the file), beside the
steps it was fitted on, the errors of each step's time predicted in sample and, without ``--steps``, both
TTFT tables and the largest out-of-sample error.

On a GPU (``--device cuda``: FlashInfer, decode under CUDA graphs) it measures a preset for that GPU
(``scripts/gpu_check.sh`` runs it); ``--quick`` (a small shape of each workload, for a CPU and
``tiny-random``) checks the path end to end in seconds.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import asdict, replace

import numpy as np

from experiments.common import environment, parser, run_cli, table, with_ext
from experiments.multiturn import PRESETS, run_cache, simulate_cache
from experiments.multiturn import parse_args as multiturn_args
from radixkv.config import DTYPES
from radixkv.cost import FIT_WEIGHTINGS, TIME_CONSTANTS, TRANSFER_FIELDS, CostModel, StepRecord
from radixkv.step_file import read_steps

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


# step classes by prefill tokens (upper bounds, exclusive): where a step model goes wrong is by class
STEP_CLASSES = (("decode", 1), ("prefill <64", 64), ("prefill 64-1023", 1024), ("prefill 1024+", float("inf")))


def step_class(record: StepRecord) -> str:
    """The class of a step by its prefill tokens (``STEP_CLASSES``; a step of decodes alone is ``decode``)."""
    return next(name for name, upper in STEP_CLASSES if record.prefill_tokens < upper)


def step_errors(cost: CostModel, records: Sequence[StepRecord]) -> dict:
    """How ``cost`` predicts the steps that ran the model (their loads at its bandwidths, ``cost.record_time``):
    the mean and the largest ``|predicted / measured - 1|`` per step, and the sum's ``predicted / measured - 1``;
    under ``by_class``, each class's steps and sum's error (``STEP_CLASSES``). O(records)."""
    steps = [r for r in records if r.computes]
    measured = np.array([r.seconds for r in steps])
    predicted = np.array([cost.record_time(r) for r in steps])
    error = np.abs(predicted / np.maximum(measured, 1e-12) - 1)
    classes = np.array([step_class(r) for r in steps])
    by_class = {name: {"steps": int((classes == name).sum()),
                       "total_error": float(predicted[classes == name].sum()
                                            / max(measured[classes == name].sum(), 1e-12) - 1)}
                for name, _ in STEP_CLASSES if (classes == name).any()}
    return {"steps": len(steps), "mean_abs_error": float(error.mean()), "max_abs_error": float(error.max()),
            "total_error": float(predicted.sum() / max(measured.sum(), 1e-12) - 1), "by_class": by_class}


def copies(records: Sequence[StepRecord]) -> dict:
    """Tokens and seconds copied between the tiers over ``records`` (what the bandwidths were fitted on)."""
    return {name: sum(getattr(r, name) for r in records) for name in TRANSFER_FIELDS}


def fit_step_files(paths: Sequence[str], weighting: str = "relative", per_chunk: bool = True) -> dict:
    """``--steps``: ``CostModel.fit`` to the records of these step files, at their KV bytes per token (one for
    all: ``ValueError`` where they differ, or for a file that is not a step file). ``per_chunk=False`` leaves
    the per-chunk constant out (``prefill_per_seq`` 0, as for files that did not count chunks). The result's
    fields."""
    files = [read_steps(path) for path in paths]
    layouts = {f.kv_bytes_per_token for f in files}
    if len(layouts) != 1:
        raise ValueError(f"the step files have different KV bytes per token {sorted(layouts)}: fit one model's "
                         "steps at a time")
    records = [r if per_chunk else replace(r, prefill_seqs=None) for f in files for r in f.records]
    cost = CostModel.fit(records, kv_bytes_per_token=layouts.pop(), weighting=weighting)
    return {"cost": asdict(cost), "fit_steps": len(records), "weighting": weighting, "per_chunk": per_chunk,
            "step_errors": step_errors(cost, records), "copies": copies(records),
            "sources": [{"path": str(p), "steps": len(f.records), "started": f.header.get("started"),
                         "engine": f.header.get("config")} for p, f in zip(paths, files, strict=True)]}


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
    p.add_argument("--steps", nargs="+", metavar="PATH", default=None,
                   help="fit the step files radixkv serve --record-steps wrote instead (no engine runs; the "
                        "workload, model and device flags are unused)")
    p.add_argument("--no-per-chunk", action="store_true", help="--steps: fit without the per-chunk constant "
                   "(prefill_per_seq stays 0)")
    p.add_argument("--weighting", default="relative", choices=FIT_WEIGHTINGS,
                   help="how a step's error counts in the least squares: relative (to its seconds: short and "
                        "long steps alike) or absolute (in seconds: long prefill steps count most)")
    args = p.parse_args(argv)
    if args.fit_preset == args.predict_preset and not args.steps:
        p.error("--predict-preset must differ from --fit-preset: the error is out of sample")
    return args


def fit_and_predict(args: argparse.Namespace) -> dict:
    """The engine runs (without ``--steps``): fit on one workload, predict the other. The result's fields."""
    fit_args, predict_args = workload_args(args, "fit"), workload_args(args, "predict")
    fit_rows, _, llm = run_cache(args.cache, fit_args, record_steps=True)
    records = llm.step_log
    cost = CostModel.fit(records, kv_bytes_per_token=llm.pool.bytes_per_slot, weighting=args.weighting)
    del llm  # its KV pool: the next engine takes the memory
    measured, _, _ = run_cache(args.cache, predict_args)
    out_of_sample = per_turn(measured, simulate_cache(args.cache, predict_args, cost)[0])
    in_sample = per_turn(fit_rows, simulate_cache(args.cache, fit_args, cost)[0])
    formats = {c: ".3g" for c in ("measured_s", "predicted_s", "error")}
    for name, rows in ((f"out of sample: {args.predict_preset}", out_of_sample),
                       (f"in sample: {args.fit_preset}", in_sample)):
        print(name)
        print(table(rows, ["turn", "measured_s", "predicted_s", "error"], formats))
    worst = max(abs(r["error"]) for r in out_of_sample)
    print(f"largest out-of-sample TTFT error per turn: {worst:.1%}")
    return {"cost": asdict(cost), "fit_steps": len(records), "weighting": args.weighting,
            "step_errors": step_errors(cost, records), "out_of_sample": out_of_sample, "in_sample": in_sample,
            "max_abs_error_out_of_sample": worst}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    fitted = fit_step_files(args.steps, args.weighting, not args.no_per_chunk) if args.steps else fit_and_predict(args)
    shown = {k: f"{fitted['cost'][k]:.3g}" for k in (*TIME_CONSTANTS, "host_bandwidth", "storage_bandwidth")}
    print(f"fitted on {fitted['fit_steps']} steps:", shown)
    errors = fitted["step_errors"]
    print(f"step time in sample: mean |error| {errors['mean_abs_error']:.1%}, largest {errors['max_abs_error']:.1%}, "
          f"the sum's {errors['total_error']:+.1%}")
    print("  the sum's error by class: " + ", ".join(f"{name} {c['total_error']:+.1%} ({c['steps']} steps)"
                                                      for name, c in errors["by_class"].items()))
    result = {"config": vars(args), "env": environment(), **fitted}
    out = with_ext(args.out, ".json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print("wrote", out, "(CostModel.load reads it)")
    return result


if __name__ == "__main__":
    run_cli(main)
