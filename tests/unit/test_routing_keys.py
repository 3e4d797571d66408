"""Derived routing keys (``routing/keys.py``): conversations behind one shared system prompt are kept apart and each
keeps its key turn after turn; nested prompts, short prompts and prompts without a full block get keys of their own;
requests on one template of their own keep one key; memory stays bounded."""

from __future__ import annotations

import random

from p2pnode.routing.keys import RoutingKeys

SYSTEM = list(range(1000, 1016))  # a 16-block platform prompt every request starts with


def conversation(c: int, turns: int, blocks_per_turn: int = 3) -> list[list[int]]:
    """The block chains of conversation ``c``'s turns: the system prompt, then its history growing each turn."""
    own = [c * 10_000 + i for i in range(turns * blocks_per_turn)]
    return [SYSTEM + own[: (t + 1) * blocks_per_turn] for t in range(turns)]


def warm(keys: RoutingKeys, conversations: range) -> None:
    """Traffic the node has routed before: conversations of three turns, their turns interleaved."""
    chats = [conversation(c, 3) for c in conversations]
    for turn in range(3):
        for c, turns in zip(conversations, chats, strict=True):
            keys.key(turns[turn], f"w{c}.{turn}")


def test_conversations_behind_one_system_prompt_get_keys_of_their_own_that_last_every_turn() -> None:
    keys = RoutingKeys()
    warm(keys, range(100, 112))
    chats = [conversation(c, 4) for c in range(1, 21)]
    seen: dict[int, set[str]] = {c: set() for c in range(20)}
    for turn in range(4):
        for c, turns in enumerate(chats):
            seen[c].add(keys.key(turns[turn], f"r{c}.{turn}"))
    # Every conversation's key is its first own block: the same for all its turns, distinct between conversations.
    assert all(len(s) == 1 for s in seen.values())
    assert len({next(iter(s)) for s in seen.values()}) == 20
    old_rule = {f"prefix:{SYSTEM[3]:016x}"}  # the fourth block, inside the system prompt: the same for everyone
    assert not any(s == old_rule for s in seen.values())


def test_before_turns_come_back_the_leading_blocks_name_the_key() -> None:
    """A cold node: the system prompt branches, but no conversation has come back yet, so nothing says its
    continuations are contexts of their own: the old rule holds until they do."""
    keys = RoutingKeys(fallback_blocks=4)
    first_turns = [keys.key(conversation(c, 1)[0], f"r{c}") for c in range(1, 10)]
    assert set(first_turns) == {f"prefix:{SYSTEM[3]:016x}"}


def test_nested_prompts_separate_the_conversations_not_the_applications() -> None:
    keys = RoutingKeys()
    rng = random.Random(1)
    apps = {a: SYSTEM + [50_000 + a * 100 + i for i in range(8)] for a in range(5)}
    result: dict[tuple[int, int], str] = {}
    for _ in range(3):  # three rounds, so that every branch point has been seen
        for a, prompt in apps.items():
            for c in range(6):
                chain = prompt + [a * 1_000_000 + c * 1000 + i for i in range(4)]
                result[(a, c)] = keys.key(chain, f"{a}.{c}.{rng.random()}")
    assert len(set(result.values())) == len(result)  # 30 conversations, 30 keys, none per application


def test_a_prompt_without_its_own_block_is_keyed_by_its_request() -> None:
    keys = RoutingKeys()
    warm(keys, range(1, 12))
    # A short question inside the partial block after the system prompt: the system prompt is all it has.
    assert keys.key(SYSTEM, "q1") == "request:q1"
    assert keys.key(SYSTEM, "q2") == "request:q2"
    assert keys.key([], "tiny") == "request:tiny"  # not even one full block


def test_requests_on_a_template_of_their_own_keep_one_key() -> None:
    """Five few-shot templates (no system prompt in front), each used by many one-off questions: a template's end
    branches but nothing after it comes back, so every question on it shares the template's key."""
    keys = RoutingKeys()
    rng = random.Random(2)
    templates = [[t * 100 + i for i in range(5)] for t in range(1, 6)]
    got: dict[int, set[str]] = {t: set() for t in range(5)}
    for q in range(200):
        t = rng.randrange(5)
        key = keys.key([*templates[t], 90_000 + q, 91_000 + q], f"q{q}")
        if q >= 100:
            got[t].add(key)
    assert all(s == {f"prefix:{templates[t][0]:016x}"} for t, s in got.items())


def test_with_nothing_learned_the_leading_blocks_name_the_key() -> None:
    chain = list(range(1, 10))
    assert RoutingKeys(fallback_blocks=4).key(chain, "r") == f"prefix:{4:016x}"
    assert RoutingKeys(fallback_blocks=4).key(chain[:2], "r") == f"prefix:{2:016x}"


def test_memory_is_bounded() -> None:
    keys = RoutingKeys(max_entries=1000)
    for c in range(2000):
        keys.key([c * 100 + i for i in range(20)], f"r{c}")
    assert len(keys._next) < 1000 and len(keys._old) <= 1000 and len(keys._fan) <= 1000 // 16 + 1
