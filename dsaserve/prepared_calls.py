"""Native operator calls with their weight arguments gathered once per module.

A decode step calls a few native operators per layer, each taking a dozen or two weight tensors and
constants. Gathered through nn.Module attribute lookups (most of a microsecond each) they cost a layer
tens of microseconds per step, as much as the smaller operators themselves. A module that makes such
calls keeps what it gathered here: made on first use (after loading), dropped whenever the module's
tensors are replaced (`_apply`: .to(), to_empty()), and by `forget_prepared(model)` after anything
else swaps a weight.
"""

from __future__ import annotations

from typing import Callable, TypeVar

from torch import nn

T = TypeVar("T")
_KEY = "_prepared_calls"
_MISSING = object()


class PreparedCalls(nn.Module):
    def prepared(self, name: str, gather: Callable[[], T]) -> T:
        """What `gather()` returned the first time this module asked for `name`."""
        cache = self.__dict__.get(_KEY)
        if cache is None:
            cache = self.__dict__[_KEY] = {}
        value = cache.get(name, _MISSING)
        if value is _MISSING:
            value = cache[name] = gather()
        return value

    def _apply(self, fn, recurse=True):
        self.__dict__.pop(_KEY, None)
        return super()._apply(fn, recurse)


def forget_prepared(model: nn.Module) -> None:
    """Drop every module's gathered arguments (after weights were replaced in place of others)."""
    for module in model.modules():
        module.__dict__.pop(_KEY, None)
