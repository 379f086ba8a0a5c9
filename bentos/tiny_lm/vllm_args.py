"""Ours → vLLM's, pure: ``SamplingParams`` and ``AsyncEngineArgs`` keyword arguments from a
request's ``Params`` and the version's policy (``vllm_engine.py`` passes them to vLLM).

* ``sampling_kwargs``: ``max_tokens``, ``min_tokens``, ``temperature`` (0: greedy),
  ``top_p``, ``stop``, ``seed`` as they are; stop strings are not returned.
* ``engine_args``: ``generation.max_running`` → ``max_num_seqs``, the model's context,
  capped by placement's ``FLEET_CONTEXT_TOKENS``, → ``max_model_len``,
  ``FLEET_TENSOR_PARALLEL`` (the Kubernetes runtime sets it from placement) →
  ``tensor_parallel_size``, the policy's ``gpu_memory_gib`` over the GPU's memory
  (``gpu_total_bytes``) → ``gpu_memory_utilization`` (``FLEET_GPU_MEMORY_UTILIZATION``
  overrides), ``FLEET_VLLM_DTYPE`` (default bfloat16: vLLM's attention kernels are for
  16-bit) and ``FLEET_VLLM_ENFORCE_EAGER`` (1: no CUDA graphs, a faster start). The model
  is the local folder the replica fetched into the node cache (``weights.model_dir``), never
  the image nor a hub; ``load_format`` follows the manifest's files (``safetensors`` when it
  lists any: vLLM then reads those alone, memory-mapped, and never unpickles a ``.bin``).
  ``generation.kv_budget_tokens`` and ``max_prefill_tokens`` have no counterpart: vLLM's
  cache is what the memory left after the weights holds, in blocks, and it chunks prefills.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

try:  # in the repo, a package; in a Bento, files at its root
    from .scheduler import Params
except ImportError:
    from scheduler import Params  # type: ignore[no-redef]

DEFAULT_GPU_MEMORY_UTILIZATION = 0.9  # vLLM's own default, when the policy names no gpu_memory_gib
MIN_GPU_MEMORY_UTILIZATION, MAX_GPU_MEMORY_UTILIZATION = 0.05, 0.95


def sampling_kwargs(params: Params) -> dict[str, Any]:
    """``SamplingParams`` keyword arguments for one request (the adapter adds the output kind)."""
    return {
        "n": 1,
        "max_tokens": params.max_tokens,
        "min_tokens": params.min_tokens,
        "temperature": float(params.temperature),
        "top_p": float(params.top_p),
        "stop": list(params.stop),
        "seed": params.seed,
        "skip_special_tokens": True,
        "include_stop_str_in_output": False,
    }


def gpu_memory_utilization(override: str | None, gpu_memory_gib: float, gpu_total_bytes: int) -> float:
    """The fraction of one GPU's memory vLLM may take: ``FLEET_GPU_MEMORY_UTILIZATION`` if set,
    else the policy's ``gpu_memory_gib`` (per GPU) over the GPU's memory, else vLLM's default."""
    if override:
        value = float(override)
        if not 0.0 < value <= 1.0:
            raise ValueError(f"FLEET_GPU_MEMORY_UTILIZATION is {override!r}; expected a fraction in (0, 1]")
        return value
    if gpu_memory_gib > 0 and gpu_total_bytes > 0:
        share = gpu_memory_gib * 2**30 / gpu_total_bytes
        return round(min(MAX_GPU_MEMORY_UTILIZATION, max(MIN_GPU_MEMORY_UTILIZATION, share)), 4)
    return DEFAULT_GPU_MEMORY_UTILIZATION


def load_format(files: Iterable[str]) -> str:
    """vLLM's ``load_format`` for a folder holding ``files`` (the manifest's paths).

    >>> load_format(["config.json", "model-00001-of-00002.safetensors"]), load_format(["pytorch_model.bin"])
    ('safetensors', 'pt')
    """
    names = list(files)
    if any(n.endswith(".safetensors") for n in names):
        return "safetensors"
    if any(n.endswith((".bin", ".pt", ".pth")) for n in names):
        return "pt"
    return "auto"


def engine_args(
    model_path: str,
    *,
    generation: Mapping[str, Any],
    context: int,
    env: Mapping[str, str],
    gpu_memory_gib: float = 0.0,
    gpu_total_bytes: int = 0,
    files: Iterable[str] = (),
) -> dict[str, Any]:
    """``AsyncEngineArgs`` keyword arguments for a version's folder and its policy.

    ``context``: the model's own (its config's ``max_position_embeddings``); placement's
    ``FLEET_CONTEXT_TOKENS``, the context its KV cache was sized for, caps it."""
    tensor_parallel = _whole(env, "FLEET_TENSOR_PARALLEL", "1", "GPUs one replica spans")
    sized_for = _whole(env, "FLEET_CONTEXT_TOKENS", str(context), "the context placement sized the KV cache for")
    return {
        "model": model_path,
        "tokenizer": model_path,
        "load_format": load_format(files),
        "dtype": env.get("FLEET_VLLM_DTYPE") or "bfloat16",
        "max_model_len": min(int(context), sized_for),
        "max_num_seqs": int(generation.get("max_running", 32)),
        "tensor_parallel_size": tensor_parallel,
        "gpu_memory_utilization": gpu_memory_utilization(
            env.get("FLEET_GPU_MEMORY_UTILIZATION"), gpu_memory_gib, gpu_total_bytes
        ),
        "enforce_eager": (env.get("FLEET_VLLM_ENFORCE_EAGER") or "0").strip().lower() in ("1", "true", "yes"),
        "scheduling_policy": "priority",
        "seed": 0,
        "disable_log_stats": False,  # RequestOutput.metrics (the queue time) needs the stats
    }


def _whole(env: Mapping[str, str], name: str, default: str, what: str) -> int:
    """A whole number >= 1 from ``env[name]`` (``default`` when unset), or ``ValueError`` naming it."""
    raw = env.get(name) or default
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{name} is {raw!r}; expected a whole number >= 1 ({what})")
    return value


def gpu_total_bytes() -> int:
    """The first visible GPU's memory, read through NVML (vLLM's dependency), so that this
    process does not initialize CUDA before vLLM starts its workers; 0 if unknown."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).total)
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - unknown: the policy's share cannot be computed
        return 0
