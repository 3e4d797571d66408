"""Derived routing keys (``routing/keys.py``): conversations behind one shared system prompt are kept apart and each
keeps its key turn after turn; nested prompts, short prompts and prompts without a full block get keys of their own;
requests on one template of their own keep one key; memory stays bounded."""

from __future__ import annotations

import random

from p2pnode.routing.keys import BRANCH_CHILDREN, MAX_KEY_DEPTH, RoutingKeys

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


class EveryBlockAsked(RoutingKeys):
    """The definition of ``key``: ``_branches`` asked for every block of the chain (``key`` reads its common case
    inline)."""

    __slots__ = ()

    def key(self, hashes: list[int], request_id: str) -> str:  # type: ignore[override]
        parent, own = -1, -1
        for i, h in enumerate(hashes[:MAX_KEY_DEPTH]):
            if self._branches(parent, h) and self._split(parent, h):
                own = i
            parent = h
        n = len(hashes)
        seen = self._fan.get(hashes[n - 1]) if n else None
        if n == 0 or (seen is not None and len(seen) >= BRANCH_CHILDREN and self._splits(hashes[n - 1])):
            return f"request:{request_id}"
        if own >= 0:
            return f"prefix:{hashes[own]:016x}"
        return f"prefix:{hashes[min(self.fallback_blocks, n) - 1]:016x}"


def test_the_inline_walk_is_the_definition() -> None:
    """Conversations behind shared prompts, templates with one-off questions, regenerated turns, chains deeper than
    the walk, and memory small enough to roll its generations and clear its branch points: every key, and everything
    learned, the same as asking ``_branches`` for every block."""
    rng = random.Random(4)
    for max_entries, max_contexts in ((65_536, 32_768), (64, 32)):
        fast, slow = RoutingKeys(max_entries=max_entries, max_contexts=max_contexts), EveryBlockAsked(
            max_entries=max_entries, max_contexts=max_contexts)
        prompts = [[rng.randrange(1 << 20) for _ in range(rng.choice([0, 1, 4, 16]))] for _ in range(5)]
        live: list[list[int]] = []
        for r in range(4000):
            op = rng.random()
            if op < 0.4 or not live:  # a new context behind one of the shared prompts
                chain = rng.choice(prompts) + [rng.randrange(1 << 20) for _ in range(rng.randrange(0, 6))]
                live.append(chain)
            elif op < 0.8:  # its next turn: the history and more
                chain = rng.choice(live)
                chain += [rng.randrange(1 << 20) for _ in range(rng.randrange(1, 4))]
            elif op < 0.9:  # a regenerated turn: the same history, another last block
                chain = [*rng.choice(live)[:-1], rng.randrange(1 << 20)]
            else:  # deeper than the walk goes
                chain = rng.choice(prompts) + [rng.randrange(1 << 20) for _ in range(MAX_KEY_DEPTH + 10)]
            if len(live) > 300:
                live.pop(0)
            assert fast.key(list(chain), f"r{r}") == slow.key(list(chain), f"r{r}"), r
            assert not any(b in fast._next or b in fast._old for b in fast._fan)  # what the inline walk relies on
            state = ("_next", "_old", "_fan", "_passes", "_kids", "_kids_old")
            assert [len(getattr(fast, a)) for a in state] == [len(getattr(slow, a)) for a in state], r
            if r % 50 == 0 or r == 3999:  # everything learned (a pass over every entry: not at every step)
                assert all(getattr(fast, a) == getattr(slow, a) for a in state), r
