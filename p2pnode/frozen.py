"""Frozen slots dataclasses built at the speed of plain ones: ``fast_init`` and ``replace``.

A frozen dataclass's generated ``__init__`` sets each field through ``object.__setattr__`` (~90 ns a field on this
host: ~2 us for a 16-field ``PeerSnapshot``), and ``dataclasses.replace`` reads every field back by name before
calling it. A routing decision builds about ten of them and the simulator many more per request. ``fast_init``
gives a class an ``__init__`` in C (``p2pnode/native/frozen.c``) that takes the same arguments, raises TypeError
where the generated one does, sets the same slots and calls ``__post_init__``; ``replace`` is
``dataclasses.replace`` for such a class. The generated ``__init__`` stays the definition: without the C extension,
or for a class it does not fit (not frozen, no slots, a field outside ``__init__``, an ``InitVar``), both fall back
to the dataclass's own.
"""

from __future__ import annotations

import dataclasses
import inspect
import types
import weakref
from typing import Any, TypeVar

try:
    from p2pnode._frozen import Init as _Init
    from p2pnode._frozen import replace as _replace
except ImportError:  # pragma: no cover - built without a C compiler
    _Init = _replace = None

__all__ = ["NATIVE", "fast_init", "generated_init", "replace"]

NATIVE = _Init is not None

T = TypeVar("T")

_REQUIRED, _DEFAULT, _FACTORY = 0, 1, 2


#: Each class given the C ``__init__``, with the generated one it replaced (the definition: ``generated_init``);
#: weak, so a class made at run time can still be freed.
_GENERATED: weakref.WeakKeyDictionary[type, Any] = weakref.WeakKeyDictionary()

#: The most fields the C ``__init__`` takes (``native/frozen.c``'s MAX_FIELDS).
MAX_FIELDS = 64


def generated_init(cls: type) -> Any:
    """The dataclass's generated ``__init__`` of ``cls`` (the one ``fast_init`` replaced, or still in place)."""
    return _GENERATED.get(cls, cls.__init__)


def _fits(cls: type) -> bool:
    """Whether the C ``__init__`` takes and sets exactly what the generated one does: a frozen slots dataclass with
    its generated ``__init__``, whose parameters are its fields (no field left out of it, no ``InitVar``), each held
    in one of its slots, at most ``MAX_FIELDS`` of them."""
    params = getattr(cls, "__dataclass_params__", None)
    init = cls.__dict__.get("__init__")
    if params is None or not params.frozen or "__slots__" not in cls.__dict__ or init is None:
        return False
    if getattr(getattr(init, "__code__", None), "co_filename", None) != "<string>":
        return False  # the class's own __init__ (or one installed already), not the generated one
    fields = dataclasses.fields(cls)
    if len(fields) > MAX_FIELDS:
        return False
    if not all(isinstance(inspect.getattr_static(cls, f.name, None), types.MemberDescriptorType) for f in fields):
        return False  # a field outside the slots (a __slots__ of the class's own)
    names = [p.name for p in list(inspect.signature(init).parameters.values())[1:]]
    return names == [f.name for f in fields if not f.kw_only] + [f.name for f in fields if f.kw_only]


def fast_init(cls: type[T]) -> type[T]:
    """Give the frozen slots dataclass ``cls`` the C ``__init__`` (a class decorator, written above ``@dataclass``);
    ``cls`` unchanged where the extension is missing or the class does not fit (``_fits``). ``inspect.signature``
    of the class still reads the generated one's parameters."""
    if _Init is None or not _fits(cls):
        return cls
    fields = dataclasses.fields(cls)
    kinds, defaults = [], []
    for f in fields:
        if f.default is not dataclasses.MISSING:
            kinds.append(_DEFAULT)
            defaults.append(f.default)
        elif f.default_factory is not dataclasses.MISSING:
            kinds.append(_FACTORY)
            defaults.append(f.default_factory)
        else:
            kinds.append(_REQUIRED)
            defaults.append(None)
    by_position = tuple(i for i, f in enumerate(fields) if not f.kw_only)  # the signature: these first, in order
    generated = cls.__dict__["__init__"]
    try:
        made = _Init(cls, tuple(f.name for f in fields), by_position, tuple(kinds), tuple(defaults),
                     hasattr(cls, "__post_init__"))
    except (TypeError, ValueError):  # a slot the C cannot write: the generated __init__ stays
        return cls
    signature = inspect.signature(cls)
    _GENERATED[cls] = generated
    cls.__init__ = made
    cls.__signature__ = signature  # type: ignore[attr-defined]
    return cls


def replace(obj: T, /, **changes: Any) -> T:
    """``dataclasses.replace(obj, **changes)``, in C for a class with ``fast_init``."""
    if _replace is not None:
        made = _replace(obj, **changes)
        if made is not NotImplemented:
            return made
    return dataclasses.replace(obj, **changes)
