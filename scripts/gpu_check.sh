#!/usr/bin/env bash
# On a machine with an NVIDIA GPU, a CUDA build of torch and a CUDA toolkit (nvcc), the whole GPU check in one
# call: FlashInfer's kernels built (scripts/gpu_warmup.py, in parallel, first), every GPU test (FlashInfer
# against the PyTorch reference backend, tests/test_attention_gpu.py; the engine in bfloat16 and float16 and
# decode under CUDA graphs against eager, tests/test_engine_gpu.py; the host tier's pinned buffer and
# side-stream copies, tests/test_tiers_gpu.py), `experiments.bench_engine --device cuda` in full (this GPU's
# floors, eager against graphs, transformers) and `experiments.cost_fit --device cuda`.
#
# Everything it writes goes to --out DIR, flat, 6 files at most: gpu_check.log (all of its output), versions.json
# (device, driver, torch, CUDA, FlashInfer), pytest.xml (the tests' JUnit report), bench_engine-cuda.json,
# cost_fit-cuda.json and flashinfer-aot.tar.xz (the built kernels, where they fit in 16 MiB): given back with
# --jit-archive, the next run loads them instead of compiling. A failed step is reported and the next one
# runs; the exit status is 1 if any failed.
#
# Online (default): pip install -e ".[dev,gpu]". Offline (--wheels DIR, DIR from scripts/prepare_gpu_wheels.sh):
# the wheels go into a temporary folder put first on PYTHONPATH, never into site-packages, and a wheel whose
# distribution this Python already has is skipped, so the machine's own torch, numpy, ... are never shadowed.
set -euo pipefail

usage() {
    cat <<'EOF'
usage: scripts/gpu_check.sh [--wheels DIR] [--out DIR] [--jit-archive FILE] [--jit-cache DIR] [--timeout SECONDS]
                           [--model NAME] [--] [PYTEST_ARGS...]

  --wheels DIR        offline: install the wheels in DIR (scripts/prepare_gpu_wheels.sh) into a temporary
                      folder instead of `pip install -e ".[dev,gpu]"`
  --out DIR           where the results go (default results/gpu-check): the log, versions.json, pytest.xml,
                      bench_engine-cuda.json, cost_fit-cuda.json, flashinfer-aot.tar.xz
  --jit-archive FILE  a flashinfer-aot.tar.xz an earlier run wrote: its kernels load instead of compiling
  --jit-cache DIR     FlashInfer's JIT workspace (FLASHINFER_WORKSPACE_BASE), kept between runs
                      (default: a temporary folder, removed at the end)
  --timeout SECONDS   the whole check's limit (default 540; on an H200 the kernels alone take about 260 s)
  --model NAME        the model of the benchmark and the cost fit (default smollm2-135m-random: SmolLM2-135M's
                      shapes with random weights, built in memory; the GGUF file does not travel offline)
  -h, --help          this text

Arguments after the options (pytest options after `--`) go to pytest.
EOF
}

die_usage() { echo "gpu_check: $1" >&2; echo "run scripts/gpu_check.sh --help for usage" >&2; exit 2; }

wheels="" jit_cache="" jit_archive="" out=results/gpu-check model=smollm2-135m-random limit=540
args=("$@")
while (($#)); do
    case "$1" in
        -h | --help) usage; exit 0 ;;
        --wheels | --jit-cache | --timeout | --out | --jit-archive | --model)
            [[ $# -ge 2 && -n "$2" && "$2" != -* ]] || die_usage "$1 needs a value"
            case "$1" in
                --wheels) wheels=$2 ;;
                --jit-cache) jit_cache=$2 ;;
                --timeout) limit=$2 ;;
                --out) out=$2 ;;
                --jit-archive) jit_archive=$2 ;;
                --model) model=$2 ;;
            esac
            shift 2 ;;
        --) shift; break ;;
        -*) die_usage "unknown option $1 (pytest options go after --)" ;;
        *) break ;;
    esac
done
pytest_args=("$@")
if [[ -n "$wheels" ]]; then
    [[ -d "$wheels" ]] || die_usage "--wheels $wheels: no such directory"
    compgen -G "$wheels/*.whl" >/dev/null || die_usage "--wheels $wheels: no .whl files in it"
    wheels=$(cd "$wheels" && pwd)
fi
[[ "$limit" =~ ^[1-9][0-9]*$ ]] || die_usage "--timeout needs a whole number of seconds, got $limit"
[[ -z "$jit_archive" || -f "$jit_archive" ]] || die_usage "--jit-archive $jit_archive: no such file"
[[ -z "$jit_archive" ]] || jit_archive=$(cd "$(dirname "$jit_archive")" && pwd)/$(basename "$jit_archive")
[[ -z "$jit_cache" ]] || { mkdir -p "$jit_cache" && jit_cache=$(cd "$jit_cache" && pwd); }

# The whole check runs under `timeout` (which kills the process group: pytest, nvcc, ninja too), its output
# also in $out/gpu_check.log.
if [[ -z "${_RADIXKV_GPU_CHECK_TIMED:-}" ]]; then
    mkdir -p "$out"
    rc=0
    _RADIXKV_GPU_CHECK_TIMED=1 timeout --kill-after=15 "$limit" bash "$0" "${args[@]}" 2>&1 |
        tee "$out/gpu_check.log" || rc=${PIPESTATUS[0]}
    ((rc != 124)) || echo "gpu_check: timed out after ${limit}s (--timeout raises the limit)" |
        tee -a "$out/gpu_check.log" >&2
    exit "$rc"
fi
out=$(cd "$out" && pwd)

cd "$(dirname "$0")/.."
start=$SECONDS
tmp=$(mktemp -d "${TMPDIR:-/tmp}/radixkv-gpu-check.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
trap 'exit 143' TERM  # so that a timeout still runs the EXIT trap

phase() {  # phase NAME COMMAND...: run one step and say how long it took
    local name=$1 t0=$SECONDS
    shift
    echo "== $name"
    "$@"
    echo "-- $name: $((SECONDS - t0)) s (total $((SECONDS - start)) s)"
}

install_online() { python3 -m pip install -q -e ".[dev,gpu]"; }

install_wheels() {
    local site=$tmp/site todo=()
    # The wheels whose distribution this Python lacks (name from the wheel's file name, as pip normalizes it).
    python3 - "$wheels"/*.whl >"$tmp/todo" <<'EOF'
import importlib.metadata
import sys
from pathlib import Path

own = []
for whl in sys.argv[1:]:
    name = Path(whl).name.split("-")[0]
    try:
        own.append(f"{name} {importlib.metadata.version(name)}")
    except importlib.metadata.PackageNotFoundError:
        print(whl)
if own:
    print(f"this Python's own, not the folder's: {', '.join(own)}", file=sys.stderr)
EOF
    mapfile -t todo <"$tmp/todo"
    if ((${#todo[@]})); then
        PIP_ROOT_USER_ACTION=ignore python3 -m pip install -q --disable-pip-version-check --no-index --no-deps \
            --no-compile --target "$site" "${todo[@]}"
    fi
    echo "installed ${#todo[@]} wheels into $site"
}

if [[ -n "$wheels" ]]; then
    phase "install the wheels of $wheels" install_wheels
    export PYTHONPATH="$tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"  # radixkv itself from this checkout
    export PATH="$tmp/site/bin:$PATH"  # ninja
else
    phase "pip install -e .[dev,gpu]" install_online
fi

if ! command -v nvcc >/dev/null && [[ ! -x "${CUDA_HOME:-/nonexistent}/bin/nvcc" ]]; then
    echo "gpu_check: no nvcc (FlashInfer compiles its kernels with it): put the CUDA toolkit's bin on PATH or set CUDA_HOME" >&2
    exit 1
fi
command -v ninja >/dev/null || { echo "gpu_check: no ninja executable (FlashInfer's JIT runs it)" >&2; exit 1; }
capability=$(python3 -c "
import sys
try:
    import torch
except ImportError as e:
    sys.exit(f'gpu_check: no torch ({e}); the check needs a CUDA build of torch installed')
if not torch.cuda.is_available():
    sys.exit(f'gpu_check: torch {torch.__version__} sees no CUDA device (a CPU build, or no driver/GPU visible)')
print('%d.%d' % torch.cuda.get_device_capability())
")
case "$capability" in
    9.0 | 10.0) arch="${capability}a" ;;  # the arch-specific targets FA3 (sm90a) and sm100a kernels need
    *) arch=$capability ;;
esac
# FlashInfer's JIT knobs, for this run only.
export FLASHINFER_CUDA_ARCH_LIST=$arch
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
export FLASHINFER_WORKSPACE_BASE=${jit_cache:-$tmp/jit}
echo "GPU: $(python3 -c 'import torch; print(torch.cuda.get_device_name())') (sm $capability, building for $arch);" \
    "nvcc: $(command -v nvcc || echo "$CUDA_HOME/bin/nvcc"); MAX_JOBS=$MAX_JOBS; JIT cache: $FLASHINFER_WORKSPACE_BASE"

failed=()
step() {  # step NAME COMMAND...: as phase, but a failure is reported and the next step runs
    local name=$1 t0=$SECONDS rc=0 verdict=""
    shift
    echo "== $name"
    "$@" || rc=$?
    ((rc == 0)) || { verdict=": FAILED with status $rc"; failed+=("$name"); }
    echo "-- $name: $((SECONDS - t0)) s (total $((SECONDS - start)) s)$verdict"
}

step "versions" python3 scripts/gpu_warmup.py --versions "$out/versions.json"
[[ -z "$jit_archive" ]] || step "load the kernels of $jit_archive" python3 scripts/gpu_warmup.py --unpack "$jit_archive"
step "compile the kernels (scripts/gpu_warmup.py)" python3 scripts/gpu_warmup.py

pack_kernels() {  # the built kernels, for the next run (--jit-archive), where they fit in one returned file
    local archive=$out/flashinfer-aot.tar.xz size
    python3 scripts/gpu_warmup.py --pack "$archive" || return 1
    size=$(stat -c %s "$archive") || return 1
    echo "flashinfer-aot.tar.xz: $((size / 1024)) KiB${wheels:+, beside $(du -sk "$wheels" | cut -f1) KiB of wheels (64 MiB carry in all)}"
    if ((size > 16 * 1024 * 1024)); then
        echo "more than 16 MiB: not kept (a returned file is 16 MiB at most)"
        rm -f "$archive"
    fi
}
step "pack the kernels" pack_kernels
step "pytest -m gpu" python3 -m pytest -q -m gpu --junitxml="$out/pytest.xml" tests/test_attention_gpu.py \
    tests/test_engine_gpu.py tests/test_tiers_gpu.py "${pytest_args[@]}"
step "bench_engine --device cuda" python3 -m experiments.bench_engine --device cuda --model "$model" \
    --out "$out/bench_engine-cuda"
step "cost_fit --device cuda" python3 -m experiments.cost_fit --device cuda --model "$model" \
    --attention-backend flashinfer --out "$out/cost_fit-cuda"
if ((${#failed[@]})); then
    echo "gpu_check: FAILED: ${failed[*]} ($((SECONDS - start)) s; results in $out)" >&2
    exit 1
fi
echo "gpu_check: passed in $((SECONDS - start)) s (results in $out)"
