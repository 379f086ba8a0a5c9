"""Memory of one replica, in GiB::

    weights  = params × bytes per parameter (fp32 4, fp16/bf16 2, int8 1, int4 0.5)
    kv       = the KV cache of a generative model, the first of:
               kv_cache_gib                                  (source "kv_cache_gib")
               max_running × context_tokens × layers × kv_width × 2 × KV bytes
                                                             (source "architecture")
               KV_DEFAULT_SHARE × weights                    (source "default share")
    estimate = (weights + kv) × (1 + RUNTIME_OVERHEAD)
    replica  = max(estimate, resources.gpu × resources.gpu_memory_gib)

``max_running`` is ``generation.max_running`` (sequences in one running batch), the rest is
``architecture`` (``fleet.catalog.policies.generation.Architecture``): kv_width = hidden × kv_heads / heads, 2 for a
key and a value, KV bytes of ``kv_dtype`` (default the model's dtype; fp16 for int8/int4
weights, whose quantization is weight-only). When the tensor-parallel degree exceeds
``kv_heads`` each key/value head is held on tp / kv_heads GPUs, and the KV cache grows by
that factor. The policy's own figure (e.g. a measured peak) wins when it is larger. Models
with ``resources.gpu: 0`` run on CPU pools; their weights and KV cache must fit
``resources.memory_gib``.
"""

from __future__ import annotations

from dataclasses import dataclass

from fleet.catalog.policies.models import ModelSpec

BYTES_PER_PARAM = {"fp32": 4.0, "fp16": 2.0, "bf16": 2.0, "int8": 1.0, "int4": 0.5}
KV_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1, "int8": 1}  # per number of the KV cache
# Where a replica's KV-cache figure came from, in order of precedence ("none": not generative).
KV_SOURCES = ("kv_cache_gib", "architecture", "default share", "none")
# Activations, CUDA context and allocator fragmentation on top of weights and KV cache.
RUNTIME_OVERHEAD = 0.2
# KV cache of a generative model whose policy does not state kv_cache_gib: a share of its
# weights, about what a few concurrent sequences of a few thousand tokens take.
KV_DEFAULT_SHARE = 0.3


@dataclass(frozen=True)
class Memory:
    """What one replica needs, part by part, in GiB (see the module docstring)."""

    weights_gib: float
    kv_cache_gib: float
    kv_source: str  # one of KV_SOURCES
    kv_tokens: int | None  # max_running × context_tokens, when the architecture sized the cache
    context_tokens: int | None
    estimate_gib: float  # (weights + KV) × (1 + RUNTIME_OVERHEAD)
    declared_gib: float  # resources.gpu × gpu_memory_gib
    how: str  # the arithmetic, for messages

    @property
    def gpu_gib(self) -> float:
        """GPU memory of one replica: the estimate, or the policy's own figure when larger."""
        return max(self.estimate_gib, self.declared_gib)


def kv_dtype(spec: ModelSpec) -> str:
    """The KV cache's number format: ``architecture.kv_dtype``, else the model's dtype, else
    fp16 for int8/int4 weights (weight-only quantization keeps 16-bit activations and KV)."""
    if spec.architecture is not None and spec.architecture.kv_dtype is not None:
        return spec.architecture.kv_dtype
    return spec.dtype if spec.dtype in ("fp32", "fp16", "bf16") else "fp16"


def kv_cache_bytes(spec: ModelSpec, tensor_parallel: int = 1) -> int:
    """max_running × context_tokens × layers × kv_width × 2 (K and V) × KV bytes, times the
    replication of key/value heads when ``tensor_parallel`` exceeds kv_heads. Needs an
    architecture and a generation section (a generative model)."""
    arch, gen = spec.architecture, spec.generation
    if arch is None or gen is None:
        raise ValueError("kv_cache_bytes needs a generative model with an architecture")
    base = gen.max_running * arch.context_tokens * arch.layers * arch.kv_width * 2 * KV_BYTES[kv_dtype(spec)]
    return base * _kv_replication(spec, tensor_parallel)


def _kv_replication(spec: ModelSpec, tensor_parallel: int) -> int:
    arch = spec.architecture
    if arch is None or arch.heads is None:
        return 1
    kv_heads = arch.kv_heads or arch.heads
    return max(1, tensor_parallel // kv_heads)


def memory(spec: ModelSpec, tensor_parallel: int = 1) -> Memory:
    """One replica's memory at ``tensor_parallel`` GPUs (the degree matters only where it
    replicates key/value heads); weights and KV of a CPU model too, which must fit its RAM."""
    weights = _weights_gib(spec)
    tokens = context = None
    if not spec.generative:
        kv, source = 0.0, "none"
    elif spec.kv_cache_gib is not None:
        kv, source = spec.kv_cache_gib, "kv_cache_gib"
    elif spec.architecture is not None and spec.generation is not None:
        kv, source = kv_cache_bytes(spec, tensor_parallel) / 2**30, "architecture"
        context = spec.architecture.context_tokens
        tokens = spec.generation.max_running * context
    else:
        kv, source = KV_DEFAULT_SHARE * weights, "default share"
    estimate = (weights + kv) * (1 + RUNTIME_OVERHEAD)
    declared = spec.resources.gpu * spec.resources.gpu_memory_gib
    how = (
        f"{spec.params_millions:g}M params {spec.dtype} = {weights:.1f} GiB weights + {kv:.1f} GiB KV cache "
        f"({_kv_how(spec, source, tensor_parallel)}) + {RUNTIME_OVERHEAD:.0%} runtime overhead = {estimate:.1f} GiB"
    )
    if declared > estimate:
        how = f"resources.gpu × gpu_memory_gib = {declared:g} GiB, above the estimate of {how}"
    return Memory(weights, kv, source, tokens, context, estimate, declared, how)


def _kv_how(spec: ModelSpec, source: str, tensor_parallel: int) -> str:
    if source == "architecture":
        arch, gen = spec.architecture, spec.generation
        assert arch is not None and gen is not None
        times = _kv_replication(spec, tensor_parallel)
        copies = f" × {times} copies of each KV head at tensor parallel {tensor_parallel}" if times > 1 else ""
        return (
            f"{gen.max_running} sequences × {arch.context_tokens} tokens × {arch.layers} layers × "
            f"{arch.kv_width} × 2 × {KV_BYTES[kv_dtype(spec)]} bytes {kv_dtype(spec)}{copies}"
        )
    return {
        "kv_cache_gib": "kv_cache_gib",
        "default share": f"{KV_DEFAULT_SHARE:.0%} of the weights",
        "none": "not generative",
    }[source]


def replica_gpu_memory_gib(spec: ModelSpec, tensor_parallel: int = 1) -> float:
    """GPU memory one replica needs (see the module docstring); 0 for a CPU-only model."""
    return 0.0 if spec.resources.gpu == 0 else memory(spec, tensor_parallel).gpu_gib


def tensor_parallel_ok(spec: ModelSpec, tensor_parallel: int) -> bool:
    """Whether a replica may span ``tensor_parallel`` GPUs: with stated heads, the degree divides
    the query heads, and the key/value heads divide it or it them (vLLM's rule)."""
    arch = spec.architecture
    if arch is None or arch.heads is None:
        return True
    kv_heads = arch.kv_heads or arch.heads
    return arch.heads % tensor_parallel == 0 and (kv_heads % tensor_parallel == 0 or tensor_parallel % kv_heads == 0)


def _weights_gib(spec: ModelSpec) -> float:
    return spec.params_millions * 1e6 * BYTES_PER_PARAM[spec.dtype] / 2**30
