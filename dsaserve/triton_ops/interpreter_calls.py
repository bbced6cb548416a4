"""Faster device-function calls under Triton's interpreter (the kernels on CPU tensors: tests, gpu_check --device cpu).

Triton 3.9's interpreter wraps triton.language's builtins for the modules a kernel's globals name when the kernel is
launched, and wraps them again on every call of a device function inside it (a helper such as `_order_key`, and the
library's own `tl.sum`, `tl.cumsum`, ...): each time it walks those modules' members, about 0.7 ms a call here, half
of the interpreted time of this project's kernels (a row top-k program makes some twenty such calls). Within one
launch the second walk over the same modules changes nothing: the builtins are already wrapped (a wrapper is not a
builtin, so it is not wrapped again) and the tensor methods are set to the same functions. `install` makes a device
call skip the walk when its modules were walked earlier in the same launch, and does nothing where the interpreter
lacks the parts it relies on (a Triton that changed them is then slower, not different).
"""

from __future__ import annotations

import inspect

_walked: set[int] = set()  # ids of the language modules wrapped during the current launch
_installed = False


def install() -> None:
    global _installed
    if _installed:
        return
    import triton.language as tl
    from triton.runtime import interpreter

    needed = (getattr(interpreter, "GridExecutor", None), getattr(interpreter, "InterpretedFunction", None),
              getattr(interpreter, "InterpreterError", None))
    if None in needed or not hasattr(interpreter.InterpretedFunction, "rewrite"):
        return
    launch, device_call = interpreter.GridExecutor.__call__, interpreter.InterpretedFunction.__call__
    languages = (tl, tl.core)

    def launch_once(self, *args, **kwargs):
        _walked.clear()
        try:
            return launch(self, *args, **kwargs)
        finally:
            _walked.clear()

    def call(self, *args, **kwargs):
        modules = {id(v) for v in self.fn.__globals__.values() if inspect.ismodule(v) and v in languages}
        if not modules <= _walked:
            _walked.update(modules)
            return device_call(self, *args, **kwargs)
        body = self.rewrite()
        try:
            return body(*args, **kwargs)
        except Exception as error:
            raise interpreter.InterpreterError(repr(error)) from error

    interpreter.GridExecutor.__call__ = launch_once
    interpreter.InterpretedFunction.__call__ = call
    _installed = True
