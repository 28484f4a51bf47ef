"""The base model's forward calls, counted: the τ denominator of every bench method, the fuzzer and the
support tests."""

from __future__ import annotations


class ForwardCounter:
    """Counts calls of the base model's forward (a hook, removed on exit): the same τ denominator for
    every method."""

    def __init__(self, model) -> None:
        self.model = model
        self.count = 0

    def __enter__(self) -> ForwardCounter:
        self._handle = self.model.register_forward_pre_hook(self._hook)
        return self

    def __exit__(self, *exc) -> None:
        self._handle.remove()

    def _hook(self, module, args) -> None:
        self.count += 1
