"""A frozen slots dataclass's C ``__init__`` and ``replace`` (``p2pnode/frozen.py``, ``native/frozen.c``) build what
the dataclass's generated ``__init__`` and ``dataclasses.replace`` build, and raise where they raise: on random
classes (positional and keyword-only fields, defaults, default factories, a validating ``__post_init__``) called with
random arguments, and on the routing classes the decision builds."""

from __future__ import annotations

import dataclasses
import inspect
import random
import sys
from dataclasses import dataclass, field
from typing import Any

import pytest

from p2pnode import frozen
from p2pnode.cache.tiers import TierDepths
from p2pnode.load import NodeLoad
from p2pnode.request import KvSource, Request, SamplingOptions
from p2pnode.routing.candidates import CandidateSet
from p2pnode.routing.policies.types import Decision, PeerSnapshot, Pull, RouteRequest
from p2pnode.routing.router import Route, RouteQuery
from p2pnode.routing.served_rate import ServedRate

pytestmark = pytest.mark.skipif(not frozen.NATIVE, reason="the C extension is not built")

HOT = [RouteRequest, PeerSnapshot, Pull, Decision, Route, RouteQuery, CandidateSet, NodeLoad, TierDepths, ServedRate,
       SamplingOptions, KvSource, Request]


def fields_of(obj: Any) -> dict[str, Any]:
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}


def by_python(cls: type, *args: Any, **kwargs: Any) -> Any:
    """``cls(*args, **kwargs)`` through the dataclass's generated ``__init__``."""
    obj = object.__new__(cls)
    frozen.generated_init(cls)(obj, *args, **kwargs)
    return obj


def outcome(make: Any) -> tuple[str, Any]:
    try:
        return "ok", fields_of(make())
    except Exception as e:  # the same exception type is the contract; messages differ
        return "raised", type(e)


@pytest.mark.parametrize("cls", HOT, ids=lambda c: c.__name__)
def test_the_routing_classes_get_the_c_init(cls: type) -> None:
    """Each class on the decision's path qualifies (a class that silently kept its generated __init__ fails here)."""
    assert type(cls.__init__) is frozen._Init


def random_class(rng: random.Random, index: int) -> tuple[type, type, list[str]]:
    """The same random frozen slots dataclass twice (generated __init__, C __init__), and its field names."""
    n = rng.randrange(0, 12)
    class_kw_only = rng.random() < 0.3
    names = [f"f{i}" for i in range(n)]
    annotations: dict[str, Any] = {}
    namespace: dict[str, Any] = {"__annotations__": annotations}
    defaulted = False
    for name in names:
        annotations[name] = "Any"
        kw_only = class_kw_only or rng.random() < 0.2
        kind = rng.random()
        if kind < 0.3 and not (defaulted and not kw_only):  # a required positional field cannot follow a default
            if kw_only:
                namespace[name] = field(kw_only=True)
            continue
        if kind < 0.6:
            namespace[name] = field(default=rng.choice([0, None, "x", (1, 2)]), kw_only=kw_only)
        else:
            namespace[name] = field(default_factory=rng.choice([list, dict, lambda: [7]]), kw_only=kw_only)
        if not kw_only:
            defaulted = True
    if n and rng.random() < 0.4:
        watched = rng.choice(names)

        def __post_init__(self: Any, watched: str = watched) -> None:
            if getattr(self, watched) == "bad":
                raise ValueError(f"{watched} is bad")

        namespace["__post_init__"] = __post_init__
    made = []
    for suffix in ("Py", "C"):
        cls = type(f"R{index}{suffix}", (), dict(namespace))
        made.append(dataclass(frozen=True, slots=True, kw_only=class_kw_only)(cls))
    plain, fast = made
    assert frozen.fast_init(fast) is fast and type(fast.__init__) is frozen._Init
    return plain, fast, names


def random_call(rng: random.Random, names: list[str]) -> tuple[list[Any], dict[str, Any]]:
    values = [rng.choice([1, "bad", None, [3], "bad"]) for _ in range(len(names) + 2)]
    npos = rng.randrange(0, len(names) + 2)
    args = values[:npos]
    kwargs = {}
    for i, name in enumerate(names):
        if rng.random() < 0.5:
            kwargs[name] = rng.choice([i, "bad", ()])
    if rng.random() < 0.1:
        kwargs["nope"] = 1
    return args, kwargs


def test_random_classes_build_and_raise_as_their_generated_init() -> None:
    rng = random.Random(7)
    built = 0
    for index in range(300):
        plain, fast, names = random_class(rng, index)
        for _ in range(20):
            args, kwargs = random_call(rng, names)
            want = outcome(lambda plain=plain, args=args, kwargs=kwargs: plain(*args, **kwargs))
            got = outcome(lambda fast=fast, args=args, kwargs=kwargs: fast(*args, **kwargs))
            assert got == want, (plain, args, kwargs)
            if want[0] == "ok":
                built += 1
                a, b = plain(*args, **kwargs), fast(*args, **kwargs)
                twin = fast(*args, **kwargs)
                given = {*kwargs, *[f.name for f in dataclasses.fields(fast) if not f.kw_only][: len(args)]}
                for name in names:  # a default factory makes a new object per instance
                    if name not in given and isinstance(getattr(b, name), list | dict):
                        assert getattr(b, name) is not getattr(twin, name)
                changes = {name: rng.choice([5, "bad"]) for name in names if rng.random() < 0.4}
                if rng.random() < 0.1:
                    changes["nope"] = 2
                assert outcome(lambda b=b, changes=changes: frozen.replace(b, **changes)) == outcome(
                    lambda a=a, changes=changes: dataclasses.replace(a, **changes)
                )
    assert built > 1000  # the random calls do build instances, not only raise


def test_the_routing_classes_build_as_their_generated_init() -> None:
    load = NodeLoad(running=2, prefill_backlog_tokens=40)
    cases: list[tuple[type, list[Any], dict[str, Any]]] = [
        (PeerSnapshot, [], {"node_id": "a", "load": load, "est_match_blocks": 3, "kv_layout": "L"}),
        (PeerSnapshot, ["a"], {}),  # keyword-only
        (PeerSnapshot, [], {}),  # node_id is required
        (NodeLoad, [], {"running": 1, "kv_usage": 0.5, "urgent_backlog_tokens": 3}),
        (RouteRequest, [(1, 2), 40, 8, "k", 16, 5], {"homes": ("a",), "kv_movable": False}),
        (RouteRequest, [(1, 2), 10, 8, "k", 16, 5], {}),  # __post_init__: fewer tokens than its blocks
        (RouteRequest, [(1, 2), 40, 8, "", 16, 5], {}),  # __post_init__: no key
        (RouteRequest, [(1, 2), 40, 8, "k", 16, 5, ("s",)], {"sampled": ("t",)}),  # a field given twice
        (Decision, [("a", "b"), "p2p"], {"est_match_blocks": 2}),
        (Decision, [("a",), "p2p", 0, "", None, 9], {}),  # too many positional
        (TierDepths, [1, 2, 3], {}),
    ]
    for cls, args, kwargs in cases:
        assert outcome(lambda cls=cls, args=args, kwargs=kwargs: cls(*args, **kwargs)) == outcome(
            lambda cls=cls, args=args, kwargs=kwargs: by_python(cls, *args, **kwargs)
        ), (cls, args, kwargs)
    route = Route(decision=Decision(("a",), "p2p", 0, ""), block_hashes=(1,), prompt_tokens=16, max_tokens=4,
                  block_size=16, addresses={}, estimates={})
    assert route._key == [] and route._key is not Route(**{**fields_of(route), "_key": []})._key
    snap = PeerSnapshot(node_id="a", load=load)
    changed = frozen.replace(snap, est_match_blocks=9, in_flight=2)
    assert fields_of(changed) == fields_of(dataclasses.replace(snap, est_match_blocks=9, in_flight=2))
    assert snap.est_match_blocks == 0 and changed.load is load
    with pytest.raises(dataclasses.FrozenInstanceError):
        changed.in_flight = 3  # still frozen
    assert changed == dataclasses.replace(snap, est_match_blocks=9, in_flight=2)
    assert hash(TierDepths(1, 2, 3)) == hash(by_python(TierDepths, 1, 2, 3))


def test_a_subclass_and_other_objects_take_the_python_paths() -> None:
    class Sub(PeerSnapshot):  # inherits the C __init__ through type.__call__
        __slots__ = ()

    sub = Sub(node_id="s", est_match_blocks=4)
    assert type(sub) is Sub and (sub.node_id, sub.est_match_blocks, sub.alive) == ("s", 4, True)
    moved = frozen.replace(sub, alive=False)  # not the Init's own class: dataclasses.replace
    assert type(moved) is Sub and moved.alive is False and moved.est_match_blocks == 4
    with pytest.raises(TypeError):
        frozen.replace(object(), x=1)  # not a dataclass, as dataclasses.replace raises
    with pytest.raises(TypeError):
        frozen.replace(PeerSnapshot(node_id="a"), nope=1)
    with pytest.raises(TypeError):
        PeerSnapshot.__init__(object(), node_id="a")  # an __init__ of the class, called on something else


def test_no_reference_is_leaked_or_lost() -> None:
    """Every value an instance holds is released with it, on success and on every error path."""
    value, default = object(), object()

    @frozen.fast_init
    @dataclass(frozen=True, slots=True)
    class Holder:
        a: Any
        b: Any = default
        c: Any = field(default_factory=lambda: value)

        def __post_init__(self) -> None:
            if self.a == "bad":
                raise ValueError("bad")

    def build_and_fail(times: int) -> tuple[int, int]:
        for _ in range(times):
            build_and_fail_once()
        return sys.getrefcount(value), sys.getrefcount(default)

    def build_and_fail_once() -> None:
        held = Holder(value)
        again = frozen.replace(held, a=value)
        del held, again
        for args, kwargs in (([value] * 4, {}), ([value], {"a": value}), ([], {"b": value}),
                             (["bad"], {"b": value})):
            with pytest.raises((TypeError, ValueError)):
                Holder(*args, **kwargs)
        with pytest.raises(ValueError):
            frozen.replace(Holder(value), a="bad", b=value)

    assert build_and_fail(10) == build_and_fail(2000)  # a reference lost or kept per call shows 1,990 times


def test_the_generated_inits_edges_hold() -> None:
    """A review's cases: each as the generated ``__init__`` or ``dataclasses.replace`` does it."""
    calls: list[str] = []

    def factory(name: str, fail: bool = False) -> Any:
        def make() -> list[str]:
            calls.append(name)
            if fail:
                raise ValueError(name)
            return [name]

        return make

    @frozen.fast_init
    @dataclass(frozen=True, slots=True)
    class Ordered:
        a: list = field(default_factory=factory("a"), kw_only=True)
        b: list = field(default_factory=factory("b"))
        c: list = field(default_factory=factory("c", fail=True), kw_only=True)
        d: int = field(kw_only=True)  # required

        def __post_init__(self) -> int:
            return 7  # ignored, as the generated __init__ ignores it

    assert type(Ordered.__init__) is frozen._Init
    with pytest.raises(TypeError):
        Ordered()  # d missing: raised before any factory runs
    assert calls == []
    with pytest.raises(ValueError, match="c"):
        Ordered(d=1)
    assert calls == ["a", "b", "c"]  # the fields' order, not the signature's
    made = Ordered(c=[], d=1)
    assert (made.a, made.b, made.d) == (["a"], ["b"], 1)
    assert frozen.replace(made, d=2).d == 2
    unset = object.__new__(Ordered)  # replace reads only the fields it does not change
    assert frozen.replace(unset, a=1, b=2, c=3, d=4) == dataclasses.replace(unset, a=1, b=2, c=3, d=4)
    assert str(inspect.signature(Ordered)) == str(inspect.signature(frozen.generated_init(Ordered))).replace(
        "(self, ", "("
    )


def test_classes_the_c_init_cannot_take_keep_their_own() -> None:
    wide = dataclass(frozen=True, slots=True)(
        type("Wide", (), {"__annotations__": {f"f{i}": "int" for i in range(frozen.MAX_FIELDS + 1)},
                          **{f"f{i}": 0 for i in range(frozen.MAX_FIELDS + 1)}})
    )
    assert type(frozen.fast_init(wide).__init__) is not frozen._Init

    @dataclass(frozen=True)
    class OwnSlots:  # a field outside the slots
        __slots__ = ("a",)
        a: int
        b: int = 0

    assert frozen.fast_init(OwnSlots) is OwnSlots and type(OwnSlots.__init__) is not frozen._Init

    made: list[str] = []

    @frozen.fast_init
    @dataclass(frozen=True, slots=True)
    class WithNew:
        a: int

        def __new__(cls, *args: Any, **kwargs: Any) -> Any:
            made.append("new")
            return object.__new__(cls)

    WithNew(1)
    frozen.replace(WithNew(1), a=2)
    assert made == ["new", "new", "new"]  # replace builds through the class's own __new__


def test_an_init_dropped_while_an_instance_is_allocated_is_still_held() -> None:
    """A collection during the allocation may run code that replaces the class's __init__: the call keeps the Init
    it found (a use after free before)."""
    import gc

    @frozen.fast_init
    @dataclass(frozen=True, slots=True)
    class K:
        a: int = 0
        b: int = 0

    generated = frozen.generated_init(K)

    def drop(phase: str, info: dict) -> None:
        if phase == "start":
            gc.callbacks.remove(drop)
            K.__init__ = generated
            [bytes(range(80)) for _ in range(50)]

    threshold = gc.get_threshold()
    gc.callbacks.append(drop)
    gc.set_threshold(1)
    try:
        made = K(1, 2)
    finally:
        gc.set_threshold(*threshold)
        if drop in gc.callbacks:
            gc.callbacks.remove(drop)
    assert (made.a, made.b) == (1, 2)
