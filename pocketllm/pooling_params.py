"""Per-request embedding settings: how a prompt's hidden states become one vector (vLLM's PoolingParams)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from pocketllm.errors import RequestError

POOLING_TYPES = ("last", "mean", "cls")  # the last token's state, the mean over the prompt, the first token's


@dataclass
class PoolingParams:
    pooling: str | None = None  # one of POOLING_TYPES; None: the model's own
    normalize: bool | None = None  # to unit length; None: as the model's config says
    dimensions: int | None = None  # the first this many dimensions (Matryoshka models), before normalizing
    n: ClassVar[int] = 1  # one sequence per request (what queue limits count)

    def __post_init__(self) -> None:
        if self.pooling is not None and self.pooling not in POOLING_TYPES:
            raise _bad("pooling", f"must be one of {', '.join(POOLING_TYPES)}; got {self.pooling!r}")
        if self.dimensions is not None and (isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int)
                                            or self.dimensions < 1):
            raise _bad("dimensions", f"must be a positive integer; got {self.dimensions!r}")

    def check_width(self, hidden_size: int) -> None:
        if self.dimensions is not None and self.dimensions > hidden_size:
            raise _bad("dimensions", f"must be at most the model's {hidden_size}; got {self.dimensions}")

    def resolved(self, pooling: str, normalize: bool, hidden_size: int) -> PoolingParams:
        """These settings with the model's defaults filled in, checked against its width."""
        self.check_width(hidden_size)
        return PoolingParams(self.pooling or pooling, normalize if self.normalize is None else self.normalize,
                             self.dimensions)


def _bad(param: str, msg: str) -> RequestError:
    err = RequestError(f"{param} {msg}")
    err.param = param
    return err
