"""Triton's interpreter, made cheaper for the CPU tests without changing what it computes.

The interpreter swaps triton.language's builtins for interpreted ones (`_patch_lang`) when a kernel launches, and
restores them when the launch ends. It also repeats that swap on every call of a nested `@triton.jit` helper, even
though the launch has already swapped the same modules: a scan of every member of triton.language, its tensor class
and its math module each time, which is most of the run time of a kernel whose programs call helpers in a loop. Here a
nested call whose modules the running launch has already swapped skips the repeat; a call that needs modules the
launch did not swap (a helper from a module that sees another of triton.language's modules) swaps them as before.
"""

from __future__ import annotations

import inspect


class _Unchanged:
    """What a skipped swap returns: nothing to restore."""

    def restore(self) -> None:
        pass


def install() -> bool:
    """Route the interpreter's swaps through the check above; False when Triton (or its interpreter) is absent."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    swap = getattr(interpreter, "_patch_lang", None)
    if swap is None or getattr(swap, "skips_repeats", False):
        return swap is not None
    swapped: list[frozenset[int]] = []  # per running launch: the language modules its swap covers
    seen: dict[int, tuple[object, frozenset[int]]] = {}  # id(fn) -> (fn, its modules): a function's imports are fixed

    def modules_of(fn) -> frozenset[int]:
        known = seen.get(id(fn))
        if known is None or known[0] is not fn:
            modules = frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core))
            known = seen[id(fn)] = (fn, modules)
        return known[1]

    def patch_lang(fn):
        wanted = modules_of(fn)
        if swapped and wanted <= swapped[-1]:
            return _Unchanged()
        scope = swap(fn)
        depth = len(swapped)
        swapped.append(wanted | (swapped[-1] if swapped else frozenset()))
        restore = scope.restore

        def restore_and_forget() -> None:
            restore()
            del swapped[depth:]

        scope.restore = restore_and_forget
        return scope

    patch_lang.skips_repeats = True
    interpreter._patch_lang = patch_lang
    return True
