"""A generative model's sections: how its replicas batch (``generation:``) and the shape its
KV cache follows (``architecture:``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from fleet.catalog.policies.spec import Spec
from fleet.validation import expected


class GenerationPolicy(Spec):
    """How a generative model's replicas batch, and what one request may ask (``generation:``).

    Per replica: the running batch holds at most ``max_running`` sequences and
    ``kv_budget_tokens`` KV-cache positions (each running sequence reserves its prompt plus
    its ``max_tokens``); past ``max_waiting`` waiting ones it sheds (503)."""

    max_running: int = Field(32, ge=1, le=4096)
    kv_budget_tokens: int = Field(8192, ge=16)
    max_waiting: int = Field(256, ge=1)
    max_prefill_tokens: int = Field(2048, ge=1)  # prompt tokens prefilled in one step, beside the decode
    max_tokens: int = Field(256, ge=1)  # the most one request may ask for (400 above)
    default_max_tokens: int = Field(16, ge=1)
    first_token_timeout_ms: int = Field(5000, gt=0)  # deadline for the first token; timeout_ms bounds the whole answer

    @model_validator(mode="after")
    def _default_within_max(self) -> GenerationPolicy:
        if self.default_max_tokens > self.max_tokens:
            raise ValueError(f"default_max_tokens {self.default_max_tokens} is above max_tokens {self.max_tokens}")
        return self


KvDtype = Literal["fp32", "fp16", "bf16", "fp8", "int8"]


class Architecture(Spec):
    """The shape of a generative model that its KV cache follows (``architecture:``; placement).

    One sequence position holds a key and a value of ``kv_width`` numbers in every layer:
    ``kv_width = hidden × kv_heads / heads`` (grouped-query attention: ``kv_heads`` key/value
    heads serve ``heads`` query heads; both unset, or equal, is plain multi-head attention,
    ``kv_width = hidden``). ``context_tokens`` is the longest sequence (prompt and output) the
    cache is sized for. ``kv_dtype`` defaults to the model's dtype, or fp16 for int8/int4
    weights (weight-only quantization keeps a 16-bit KV cache)."""

    layers: int = Field(ge=1, le=1024)  # transformer blocks
    hidden: int = Field(ge=1)  # model (embedding) width
    heads: int | None = Field(None, ge=1)  # query heads; needed with kv_heads
    kv_heads: int | None = Field(None, ge=1)  # key/value heads (GQA, MQA: 1); default heads
    context_tokens: int = Field(ge=1)  # positions one sequence may reach, prompt and output
    kv_dtype: KvDtype | None = None  # of the KV cache; default: see the class docstring

    @model_validator(mode="after")
    def _heads_divide(self) -> Architecture:
        if self.kv_heads is not None and self.heads is None:
            raise expected(f"the number of query heads when kv_heads is set (kv_heads {self.kv_heads})", field="heads")
        if self.heads is not None and self.hidden % self.heads:
            raise expected(f"a number of heads that divides hidden ({self.hidden})", field="heads", got=self.heads)
        if self.kv_heads is not None and self.heads is not None and self.heads % self.kv_heads:
            raise expected(
                f"a number of key/value heads that divides heads ({self.heads}), e.g. 8 for 64 heads",
                field="kv_heads",
                got=self.kv_heads,
            )
        return self

    @property
    def kv_width(self) -> int:
        """Numbers in one layer's key (or value) of one position: hidden × kv_heads / heads."""
        if self.heads is None or self.kv_heads is None:
            return self.hidden
        return self.hidden * self.kv_heads // self.heads
