"""Which device and which engine a replica of a generative model runs (pure, but for the probe).

``FLEET_DEVICE`` = ``auto`` | ``cuda`` | ``cpu`` picks the device (``resolve_device``).
``FLEET_ENGINE`` = ``auto`` (default) takes vLLM (``vllm_engine.py``) on CUDA when ``vllm``
imports and the version needs nothing only the native engine (``engine.py``) does (int8
weights by torchao, rehearsal faults), else the native engine; ``vllm`` insists (the replica
fails to start, saying why, if it cannot); ``native`` never takes vLLM (``choose_engine``).
``try_import_vllm`` is the probe: vLLM's wheel is CUDA-only, and importing it takes seconds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

ENGINES = ("auto", "vllm", "native")
DEVICES = ("auto", "cuda", "cpu")


class EngineUnavailable(RuntimeError):
    """What the environment asks for cannot run here (the replica should not start)."""


def resolve_device(requested: str | None, cuda_available: bool) -> str:
    """``FLEET_DEVICE`` (``auto``, ``cuda``, ``cpu``; unset is ``auto``) → ``cuda`` or ``cpu``."""
    want = (requested or "auto").strip().lower()
    if want not in DEVICES:
        raise ValueError(f"FLEET_DEVICE is {requested!r}; expected one of {', '.join(DEVICES)}")
    if want == "cuda" and not cuda_available:
        raise EngineUnavailable(
            "FLEET_DEVICE=cuda, but torch sees no CUDA device (a CPU build of torch, no driver, or "
            "CUDA_VISIBLE_DEVICES hides it); set FLEET_DEVICE=cpu or auto"
        )
    if want == "auto":
        return "cuda" if cuda_available else "cpu"
    return want


@dataclass(frozen=True)
class EngineChoice:
    engine: str  # "vllm" or "native"
    reason: str  # why, for the replica's log and /metadata


def choose_engine(
    requested: str | None,
    *,
    device: str,
    vllm_import: Callable[[], str | None],
    quantized: bool = False,
    faults: bool = False,
) -> EngineChoice:
    """``FLEET_ENGINE`` (``auto``, ``vllm``, ``native``; unset is ``auto``) → the engine.

    ``vllm_import()`` returns None when ``vllm`` imports, else why not; it is called only
    when nothing else rules vLLM out (importing vLLM takes seconds)."""
    want = (requested or "auto").strip().lower()
    if want not in ENGINES:
        raise ValueError(f"FLEET_ENGINE is {requested!r}; expected one of {', '.join(ENGINES)}")
    if want == "native":
        return EngineChoice("native", "FLEET_ENGINE=native")
    blockers = []
    if device != "cuda":
        blockers.append(f"the replica runs on {device} and vLLM's engine is CUDA-only here")
    if quantized:
        blockers.append("this version's int8 weights (fleet_quantization.json, torchao) are the native engine's")
    if faults:
        blockers.append("this version's rehearsal faults (fleet_faults.json) are the native engine's")
    if not blockers and (error := vllm_import()) is not None:
        blockers.append(f"vllm does not import ({error})")
    if not blockers:
        return EngineChoice("vllm", "FLEET_ENGINE=vllm" if want == "vllm" else "CUDA, and vllm imports")
    if want == "vllm":
        raise EngineUnavailable(f"FLEET_ENGINE=vllm, but {'; '.join(blockers)}; set FLEET_ENGINE=native or auto")
    return EngineChoice("native", "; ".join(blockers))


def try_import_vllm() -> str | None:
    """None when ``vllm`` imports, else the error (a missing wheel, or CUDA libraries that fail to load)."""
    try:
        import vllm  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any failure means: not this engine
        return f"{type(exc).__name__}: {exc}"
    return None
