"""Stream migration on three in-process nodes over real loopback gRPC (simulated engines): an engine that fails after
streaming N tokens, and the ingress continuing the sequence elsewhere from exactly there -- each token once, then what
a fresh request of the prompt and those tokens produces -- or, for requests a continuation would not reproduce and
past ``--migration-limit``, ending it with the partial output as before. ``TextSeam``'s mending of held-back text is
tested on its own, with a tokenizer whose tokens are bytes."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest

from p2pnode.client import GenerateResult, build_request, collect, wait_for_members
from p2pnode.config import EngineConfig, NodeConfig, RoutingConfig, ServerConfig
from p2pnode.engine.base import EngineDeadError, GenerationChunk
from p2pnode.engine.simulated.realtime import SimEngine
from p2pnode.gossip.config import GossipConfig
from p2pnode.node import Node
from p2pnode.request import Request
from p2pnode.serving.migration import SeamCut, StopSeam, TextSeam
from p2pnode.v1 import node_pb2_grpc
from tests.unit.sim_nodes import BLOCK, SECRET

PROMPT = list(range(100, 100 + 3 * BLOCK + 5))
MAX_TOKENS = 24


class Faults:
    """Every node's engine, wrapped: one token per chunk, and the first ``armed`` requests fail after ``after``
    tokens (their engine raises EngineDeadError, as vLLM's does when its core dies). Records what each engine got."""

    def __init__(self) -> None:
        self.armed = 0
        self.after = 0
        self.served: list[tuple[str, Request]] = []
        self.failed: list[str] = []

    def wrap(self, node: Node) -> None:
        original = node.engine.generate

        async def generate(request: Request, *args, **kwargs) -> AsyncIterator[GenerationChunk]:  # type: ignore[no-untyped-def]
            self.served.append((node.config.node_id, request))
            fail = self.armed > 0
            self.armed -= fail
            sent, text, shown = 0, "", 0
            s = request.sampling
            held = max(map(len, s.stop)) - 1 if s.stop and not s.include_stop_str_in_output else 0
            async for chunk in original(request, *args, **kwargs):
                for piece in _one_token_chunks(chunk):
                    if fail and sent == self.after:
                        self.failed.append(node.config.node_id)
                        raise EngineDeadError("injected engine failure")
                    sent += len(piece.token_ids)
                    # like vLLM's detokenizer, hold back what may begin a stop string until the stream ends
                    text += piece.text
                    end = len(text) if piece.finish_reason is not None else max(shown, len(text) - held)
                    yield dataclasses.replace(piece, text=text[shown:end])
                    shown = end

        node.engine.generate = generate  # type: ignore[method-assign]


def _one_token_chunks(chunk: GenerationChunk) -> Iterator[GenerationChunk]:
    """``chunk`` as one chunk per token (the simulated engine's text is one character per token)."""
    n = len(chunk.token_ids)
    if n <= 1:
        yield chunk
        return
    for i, token in enumerate(chunk.token_ids):
        last = i == n - 1
        yield dataclasses.replace(
            chunk, token_ids=(token,), text=chunk.text[i], logprobs=chunk.logprobs[i:i + 1],
            finish_reason=chunk.finish_reason if last else None, prompt_logprobs=chunk.prompt_logprobs if not i else (),
        )


def make_node(node_id: str, migration_limit: int, seeds: tuple[str, ...] = ()) -> Node:
    config = NodeConfig(
        node_id=node_id,
        engine=EngineConfig(model=Path("models/sim"), block_size=BLOCK),
        server=ServerConfig(listen="127.0.0.1:0"),
        gossip=GossipConfig(cluster_secret=SECRET, interval_s=0.05),
        seeds=seeds,
        routing=RoutingConfig(migration_limit=migration_limit),
    )
    return Node(config, SimEngine(block_size=BLOCK, num_blocks=1024, max_model_len=4096, name=node_id))


@dataclasses.dataclass
class Mesh:
    nodes: list[Node]
    faults: Faults

    async def generate(self, prompt: list[int], **kw: object) -> GenerateResult:
        async with grpc.aio.insecure_channel(self.nodes[0].address) as channel:
            return await collect(node_pb2_grpc.NodeStub(channel), build_request(prompt, **kw), timeout=60)  # type: ignore[arg-type]

    async def fresh(self, prompt: list[int], max_tokens: int) -> GenerateResult:
        """What a request served by one node, start to end, produces."""
        self.faults.armed = 0
        return await self.generate(prompt, max_tokens=max_tokens, temperature=0.0)


async def start_mesh(migration_limit: int) -> Mesh:
    first = make_node("A", migration_limit)
    await first.start()
    nodes = [first]
    for node_id in ("B", "C"):
        node = make_node(node_id, migration_limit, seeds=(first.address,))
        await node.start()
        nodes.append(node)
    await wait_for_members([n.address for n in nodes], timeout_s=30, poll_s=0.05)
    faults = Faults()
    for node in nodes:
        faults.wrap(node)
    return Mesh(nodes, faults)


@pytest.fixture
async def mesh(request: pytest.FixtureRequest) -> AsyncIterator[Mesh]:
    made = await start_mesh(getattr(request, "param", 1))
    yield made
    for node in made.nodes:
        await node.stop(leave=False)


@pytest.mark.parametrize("after", [1, 6, 20])
async def test_a_stream_whose_node_fails_continues_elsewhere_with_each_token_once(mesh: Mesh, after: int) -> None:
    mesh.faults.armed, mesh.faults.after = 1, after
    result = await mesh.generate(PROMPT, max_tokens=MAX_TOKENS, temperature=0.0)
    failed = mesh.faults.failed
    assert len(failed) == 1 and result.served_by != failed[0]
    # the client got the tokens sent before the failure once, then what prompt + those tokens produce afresh
    head = await mesh.fresh(PROMPT, after)
    tail = await mesh.fresh(PROMPT + head.token_ids, MAX_TOKENS - after)
    assert result.token_ids == head.token_ids + tail.token_ids
    assert result.text == head.text + tail.text
    assert (result.prompt_tokens, result.completion_tokens) == (len(PROMPT), MAX_TOKENS)
    original = mesh.faults.served[0][1]
    assert (result.migrations, result.finish_reason, result.request_id) == (1, "length", original.request_id)
    node, continued = mesh.faults.served[1]
    assert node == result.served_by
    assert list(continued.tokens) == PROMPT + head.token_ids
    assert (continued.max_tokens, continued.sampling.prompt_logprobs) == (MAX_TOKENS - after, None)
    assert continued.request_id.endswith(".m1")
    assert mesh.nodes[0].router.counters.migrations == 1
    # a continuation is no retry, and its final reads as the client's request: nothing cached past its prompt
    assert result.attempts == 1 and mesh.nodes[0].router.counters.retries == 0
    assert result.cached_tokens <= result.prompt_tokens and result.index_match_tokens <= result.prompt_tokens


async def test_a_continued_sequence_reports_no_more_cached_tokens_than_its_prompt(mesh: Mesh) -> None:
    """The continuation's prompt is the prompt and the tokens streamed: a node holding those (an earlier run's
    continuation) reported cached 96 of a 40-token prompt, in the final, the access line and HTTP's usage."""
    prompt = list(range(100, 140))
    for _ in range(2):
        mesh.faults.armed, mesh.faults.after = 1, 70
        result = await mesh.generate(prompt, max_tokens=100, temperature=0.0)
        assert result.migrations == 1 and result.prompt_tokens == 40
        assert result.cached_tokens <= 40 and result.index_match_tokens <= 40 and result.estimated_match_tokens <= 40
        assert sum(result.tier_hits.values()) <= result.cached_tokens


async def test_a_continuation_no_node_can_take_ends_unavailable_never_with_a_status_that_asks_a_retry(
    mesh: Mesh,
) -> None:
    """Every candidate for the continuation full: the call ended RESOURCE_EXHAUSTED (HTTP 429), which clients retry
    -- duplicating the output they already received; after output a failure is UNAVAILABLE."""
    from p2pnode.serving.errors import ServeCode, TargetFailed
    from p2pnode.serving.ingress import Ingress

    ingress = mesh.nodes[0].ingress
    assert ingress is not None
    original = Ingress._source

    def source(self: Ingress, target: str, route: object, request: Request) -> object:
        if ".m" not in request.request_id:
            return original(self, target, route, request)  # type: ignore[arg-type]

        async def full() -> AsyncIterator[object]:
            raise TargetFailed(target, ServeCode.RESOURCE_EXHAUSTED, "overloaded", retryable=True, retry_after_s=2.0)
            yield

        return full()

    ingress._source = source.__get__(ingress)  # type: ignore[method-assign]
    mesh.faults.armed, mesh.faults.after = 1, 6
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await mesh.generate(PROMPT, max_tokens=MAX_TOKENS, temperature=0.0)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "after streaming 6 tokens" in (info.value.details() or "")


async def test_min_tokens_counts_the_tokens_already_sent(mesh: Mesh) -> None:
    mesh.faults.armed, mesh.faults.after = 1, 6
    async with grpc.aio.insecure_channel(mesh.nodes[0].address) as channel:
        request = build_request(PROMPT, max_tokens=MAX_TOKENS, temperature=0.0)
        request.sampling.min_tokens = 10
        result = await collect(node_pb2_grpc.NodeStub(channel), request, timeout=60)
    assert result.migrations == 1 and len(result.token_ids) == MAX_TOKENS
    assert mesh.faults.served[1][1].sampling.min_tokens == 4


async def test_a_sibling_sequence_migrates_on_its_own_unseeded_sampling_too(mesh: Mesh) -> None:
    """n = 2 needs random sampling: unseeded, it migrates (the simulated engine's output depends on the prompt
    alone, so the continuation is still comparable with a fresh request)."""
    mesh.faults.armed, mesh.faults.after = 1, 6
    async with grpc.aio.insecure_channel(mesh.nodes[0].address) as channel:
        request = build_request(PROMPT, max_tokens=MAX_TOKENS, temperature=0.7)
        request.n = 2
        finals, tokens = {}, {0: [], 1: []}
        async for message in node_pb2_grpc.NodeStub(channel).Generate(request, timeout=60):
            tokens[message.index].extend(message.token_ids)
            if message.HasField("final"):
                finals[message.index] = message.final
    assert sorted(f.migrations for f in finals.values()) == [0, 1]
    assert all(len(t) == MAX_TOKENS and finals[i].completion_tokens == MAX_TOKENS for i, t in tokens.items())
    migrated = next(i for i, f in finals.items() if f.migrations)
    head = await mesh.fresh(PROMPT, 6)
    tail = await mesh.fresh(PROMPT + head.token_ids, MAX_TOKENS - 6)
    assert tokens[migrated] == head.token_ids + tail.token_ids
    continued = [r.request_id for _, r in mesh.faults.served if r.request_id.endswith(".m1")]
    assert continued == [f"{finals[migrated].request_id}.m1"]


def letters(tokens: list[int]) -> str:
    """The simulated engine's text of ``tokens`` (one letter each), as a decode that matches its stream."""
    return "".join(chr(ord("a") + t % 26) for t in tokens)


@pytest.mark.parametrize(("start", "include"), [(-1, False), (-1, True), (-2, False), (1, False)])
async def test_a_stop_string_across_the_seam_ends_the_sequence_as_one_engine_would(
    mesh: Mesh, start: int, include: bool
) -> None:
    """The simulated engine applies no stop strings: the ones here are checked by the ingress alone, a stop string
    starting ``start`` characters from the seam (before it: neither engine saw it whole; 1: inside the
    continuation's first characters, where the ingress checks too)."""
    after = 6
    head = await mesh.fresh(PROMPT, after)
    tail = await mesh.fresh(PROMPT + head.token_ids, MAX_TOKENS - after)
    text = head.text + tail.text
    stop = text[after + start:after + start + 3]
    assert stop not in text[:after + start + 2]  # its first occurrence is this one
    ends = after + start + 3  # the characters up to its end: one per token
    for node in mesh.nodes:
        node.engine.decode = lambda ids, skip_special_tokens=True: letters(ids)  # type: ignore[method-assign]
    mesh.faults.armed, mesh.faults.after = 1, after
    async with grpc.aio.insecure_channel(mesh.nodes[0].address) as channel:
        request = build_request(PROMPT, max_tokens=MAX_TOKENS, temperature=0.0, stop=[stop, "no such stop"])
        request.sampling.include_stop_str_in_output = include
        result = await collect(node_pb2_grpc.NodeStub(channel), request, timeout=60)
    assert (result.migrations, result.finish_reason) == (1, "stop")
    assert result.token_ids == (head.token_ids + tail.token_ids)[:ends]  # the tokens after the stop's last dropped
    assert result.text == text[:ends if include else ends - 3]
    assert result.completion_tokens == ends


async def test_a_stop_string_past_the_window_is_the_continuations_node_own(mesh: Mesh) -> None:
    for node in mesh.nodes:
        node.engine.decode = lambda ids, skip_special_tokens=True: letters(ids)  # type: ignore[method-assign]
    mesh.faults.armed, mesh.faults.after = 1, 6
    result = await mesh.generate(PROMPT, max_tokens=MAX_TOKENS, temperature=0.0, stop=["#"])
    head = await mesh.fresh(PROMPT, 6)
    tail = await mesh.fresh(PROMPT + head.token_ids, MAX_TOKENS - 6)
    assert (result.migrations, result.finish_reason) == (1, "length")
    assert (result.token_ids, result.text) == (head.token_ids + tail.token_ids, head.text + tail.text)


@pytest.mark.parametrize(
    ("kw", "why"),
    [
        ({"temperature": 0.8, "seed": 7}, "seeded sampling"),
        ({"temperature": 0.0, "stop": ["zz"]}, "stop strings cannot be checked"),  # letters are not its decode
        ({"temperature": 0.0, "segments": [(0, 2 * BLOCK)], "segment_reuse": "exact"}, "segment layout"),
    ],
)
async def test_a_request_a_continuation_would_not_reproduce_ends_with_its_partial_output(
    mesh: Mesh, kw: dict[str, object], why: str
) -> None:
    mesh.faults.armed, mesh.faults.after = 1, 6
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await mesh.generate(PROMPT, max_tokens=MAX_TOKENS, **kw)
    assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "failed after streaming 6 tokens" in (raised.value.details() or "")
    assert why in (raised.value.details() or "")
    assert len(mesh.faults.served) == 1 and mesh.nodes[0].router.counters.migrations == 0


async def test_the_migration_limit_is_honoured(mesh: Mesh) -> None:
    mesh.faults.armed, mesh.faults.after = 2, 3  # the sequence's node and its continuation's both fail
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await mesh.generate(PROMPT, max_tokens=MAX_TOKENS, temperature=0.0)
    assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "failed after streaming 6 tokens" in (raised.value.details() or "")
    assert "--migration-limit 1" in (raised.value.details() or "")
    assert len(mesh.faults.served) == 2 and mesh.nodes[0].router.counters.migrations == 1


@pytest.mark.parametrize("mesh", [2], indirect=True)
async def test_a_sequence_continues_as_often_as_the_limit_allows_never_on_a_node_that_failed_it(mesh: Mesh) -> None:
    mesh.faults.armed, mesh.faults.after = 2, 3
    result = await mesh.generate(PROMPT, max_tokens=MAX_TOKENS, temperature=0.0)
    assert (result.migrations, len(result.token_ids), result.completion_tokens) == (2, MAX_TOKENS, MAX_TOKENS)
    served_by = [node for node, _ in mesh.faults.served]
    assert len(set(served_by)) == 3 and result.served_by == served_by[2]
    assert [r.request_id.rsplit(".", 1)[-1] for _, r in mesh.faults.served[1:]] == ["m1", "m2"]
    first = await mesh.fresh(PROMPT, 3)
    second = await mesh.fresh(PROMPT + first.token_ids, 3)
    third = await mesh.fresh(PROMPT + first.token_ids + second.token_ids, MAX_TOKENS - 6)
    assert result.token_ids == first.token_ids + second.token_ids + third.token_ids


@pytest.mark.parametrize("mesh", [0], indirect=True)
async def test_migration_off_ends_the_call_with_its_partial_output(mesh: Mesh) -> None:
    mesh.faults.armed, mesh.faults.after = 1, 6
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await mesh.generate(PROMPT, max_tokens=MAX_TOKENS, temperature=0.0)
    assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "--migration-limit 0" in (raised.value.details() or "")
    assert len(mesh.faults.served) == 1


# --- the text across the seam ---------------------------------------------------------------------------------


def byte_decode(tokens: list[int]) -> str:
    """A tokenizer whose tokens are bytes (a character may span tokens), as a detokenizer's decode."""
    return bytes(tokens).decode(errors="replace")


def test_text_the_failed_node_held_back_is_sent_once_with_the_continuations_first_token() -> None:
    prompt = list(b"say: ")
    streamed = list("ab\u00e9".encode())  # a, b, then the first byte of a two-byte character
    seam = TextSeam(byte_decode, prompt, streamed[:3], "ab")  # the node held the split character back
    second_byte, c = streamed[3], ord("c")
    # the continuation's node decodes the second byte without its first: it would send U+FFFD, or nothing
    assert seam.text([second_byte], "\ufffd") == "\u00e9"
    assert seam.text([c], "c") == "c"  # past the seam the node's own text is right


def test_a_message_of_several_tokens_ending_inside_a_character_sends_its_whole_ones() -> None:
    """A continuation message carrying several tokens (merged under back-pressure, speculative decoding) whose last
    one begins a character: its whole characters were all held back with it -- lost for good when the message was
    the final one (max_tokens cut inside an emoji)."""
    seam = TextSeam(byte_decode, list(b"say: "), list(b"ab"), "ab")
    assert seam.text([ord("c"), 0xE2], "c") == "c"
    seam = TextSeam(byte_decode, list(b"say: "), [*b"ab", 0xC3], "ab")
    assert seam.text([0xA9, ord("c"), ord("d"), 0xE2], "\ufffdcd") == "\u00e9cd"


def test_a_stop_token_ends_the_continuation_without_its_text() -> None:
    """A plain (not special) stop token as the continuation's first token: vLLM leaves its text out unless
    include_stop_str_in_output; the seam sent it."""
    seam = TextSeam(byte_decode, list(b"say: "), list(b"ab"), "ab")
    assert seam.text([ord("\n")], "", stop_token=True) == ""
    seam = TextSeam(byte_decode, list(b"say: "), [*b"ab", 0xC3], "ab")
    assert seam.text([0xA9, ord("\n")], "", stop_token=True) == "\u00e9"


def test_a_character_split_across_the_seam_waits_for_its_last_byte() -> None:
    three = list("\u20ac".encode())  # three bytes
    seam = TextSeam(byte_decode, [1, 2], [ord("x"), three[0]], "x")
    assert seam.text([three[1]], "") == ""
    assert seam.text([three[2], ord("y")], "\ufffdy") == "\u20acy"


def test_text_held_back_at_the_seam_comes_with_a_final_message_without_tokens() -> None:
    seam = TextSeam(byte_decode, [], list(b"hello"), "hel")
    assert seam.text([], "") == "lo"


def test_a_character_never_finished_is_never_sent_even_at_the_end() -> None:
    seam = TextSeam(byte_decode, [], [ord("a"), 0xE2], "a")  # a stream sends no unfinished character, to its end
    assert seam.text([0x82], "") == ""


def test_a_stop_string_held_back_by_the_failed_node_and_finished_by_the_continuation() -> None:
    prompt = list(b"q: ")
    streamed = list(b"one END")  # the failed node sent "one " and held back "END": it may begin "END!"
    seam = StopSeam.build(byte_decode, prompt, streamed, "one ", ("END!",), include=False)
    assert seam is not None
    assert seam.take([ord("!"), ord("x")], "") == SeamCut("", 1, "END!")


def test_no_stop_across_the_seam_sends_the_held_back_text_once_then_the_nodes_own() -> None:
    seam = StopSeam.build(byte_decode, [], list(b"ab E"), "ab", ("END",), include=False)  # " E" held back
    assert seam is not None
    assert seam.take(list(b"Nx"), "") == SeamCut(" E")  # "Nx" held back: "x" could not begin "END", but the engine
    assert seam.take(list(b"y"), "N") == SeamCut("N")  # holds back as many characters whatever they are
    assert seam.take(list(b"z"), "xy") == SeamCut("xy")  # past the window: the node's own text, less what was sent
    assert seam.take([], "z") == SeamCut("z")


def test_a_stop_token_leaves_its_text_out() -> None:
    seam = StopSeam.build(byte_decode, [], list(b"ab"), "a", ("bcd",), include=False)
    assert seam is not None
    assert seam.take(list(b"cd"), "", last=True, by_token=True) == SeamCut("bc")  # "d": a stop token, no "bcd"


def test_a_stop_seam_needs_the_decode_to_be_the_stream() -> None:
    assert StopSeam.build(byte_decode, [], list(b"ab"), "XY", ("b",), include=False) is None


def test_an_engine_whose_stream_is_not_its_decode_is_passed_through() -> None:
    seam = TextSeam(byte_decode, list(b"p"), list(b"ab"), "XY")  # e.g. the simulated engine's letters
    assert seam.text(list(b"c"), "Z") == "Z"
    assert seam.text(list(b"d"), "W") == "W"


def test_across_every_seam_the_client_gets_the_text_one_vllm_stream_would_have_sent() -> None:
    """The tiny model's tokenizer, detokenized as vLLM's stream does (``DecodeStream`` primed with the prompt, reset
    when a prefix turns invalid): a stream cut after any token and continued from prompt + those tokens sends, with
    the seam mended, the text of one uncut stream -- characters split across tokens and invalid bytes included
    (without the mending, most cuts of the random sequences lose or garble text)."""
    from tokenizers.decoders import DecodeStream
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(Path(__file__).resolve().parents[2] / "models" / "tiny")
    backend = tokenizer.backend_tokenizer

    def stream(prompt: list[int], outputs: list[int]) -> list[str]:
        decoder, texts = DecodeStream(ids=prompt, skip_special_tokens=True), []
        for token in outputs:
            try:
                text = decoder.step(backend, token)
            except Exception as e:  # vLLM's recovery from a non-monotonic prefix
                if "invalid prefix" not in str(e).lower():
                    raise
                decoder = DecodeStream(skip_special_tokens=True)
                text = decoder.step(backend, token)
            texts.append(text or "")
        return texts

    def decode(ids: list[int]) -> str:
        return str(tokenizer.decode(ids, skip_special_tokens=True))

    rng = random.Random(0)
    words = tokenizer.encode("héllo wörld — naïve café 日本語のテキスト 🙂 plain text 12345", add_special_tokens=False)
    for trial in range(8):
        prompt = tokenizer.encode(f"prompt {trial}:", add_special_tokens=True)
        outputs = words if trial % 2 else [rng.randrange(3, len(tokenizer)) for _ in range(24)]
        whole = "".join(stream(prompt, outputs))
        for cut in range(1, len(outputs)):
            sent = "".join(stream(prompt, outputs[:cut]))
            seam = TextSeam(decode, prompt, outputs[:cut], sent)
            rest = stream([*prompt, *outputs[:cut]], outputs[cut:])
            assert sent + "".join(seam.text([t], x) for t, x in zip(outputs[cut:], rest, strict=True)) == whole


def test_stop_strings_across_every_seam_end_the_sequence_where_one_vllm_engine_would() -> None:
    """vLLM's own detokenizer and stop-string checks (``IncrementalDetokenizer``, the tiny model's tokenizer) on a
    greedy output cut after any token and continued from prompt + those tokens by a second engine, ``StopSeam``
    between them: the client gets the tokens, the text and the stop string of one uncut engine -- or, where the cut
    falls inside a character, the seam refuses (the request is not migrated)."""
    import types

    from transformers import AutoTokenizer
    from vllm import SamplingParams
    from vllm.v1.engine.detokenizer import IncrementalDetokenizer

    tokenizer = AutoTokenizer.from_pretrained(Path(__file__).resolve().parents[2] / "models" / "tiny")

    def decode(ids: list[int]) -> str:
        return str(tokenizer.decode(ids, skip_special_tokens=True))

    def engine(
        prompt: list[int], outputs: list[int], stop: list[str], include: bool
    ) -> list[tuple[list[int], str, str, bool]]:
        """One engine's messages (one per step): tokens kept, text, the stop string that ended it, finished."""
        params = SamplingParams(stop=stop, include_stop_str_in_output=include, max_tokens=len(outputs))
        detokenizer = IncrementalDetokenizer.from_new_request(
            tokenizer, types.SimpleNamespace(request_id="r", prompt_token_ids=prompt, sampling_params=params)
        )
        messages = []
        for i, token in enumerate(outputs):
            kept = len(detokenizer.output_token_ids)
            stopped = detokenizer.update([token], False)
            finished = stopped is not None or i == len(outputs) - 1
            text = detokenizer.get_next_output_text(finished, True)
            messages.append((list(detokenizer.output_token_ids[kept:]), text, stopped or "", finished))
            if finished:
                break
        return messages

    rng = random.Random(3)
    words = tokenizer.encode("héllo wörld, the END of it! and more words; 12345 done.", add_special_tokens=False)
    refused = compared = 0
    for trial in range(12):
        prompt = tokenizer.encode(f"prompt {trial}:", add_special_tokens=True)
        text = decode(words)
        stops = [text[(a := rng.randrange(len(text) - 5)):a + rng.randrange(1, 6)] for _ in range(1 + trial % 2)]
        include = trial % 3 == 0
        whole = engine(prompt, words, stops, include)
        expected = ([t for m in whole for t in m[0]], "".join(m[1] for m in whole), whole[-1][2])
        for cut in range(1, len(whole)):
            head = [t for m in whole[:cut] for t in m[0]]
            seam = StopSeam.build(decode, prompt, head, "".join(m[1] for m in whole[:cut]), tuple(stops), include)
            if seam is None:
                refused += 1
                assert decode(head).endswith("\ufffd")  # refused only inside a character
                continue
            tokens, sent, stopped = list(head), "".join(m[1] for m in whole[:cut]), ""
            for kept, node_text, node_stop, finished in engine([*prompt, *head], words[len(head):], stops, include):
                seam_cut = seam.take(kept, node_text, last=finished)
                sent += seam_cut.text
                tokens += kept[:seam_cut.keep]
                stopped = seam_cut.stop or node_stop
                if seam_cut.stop or finished:
                    break
            assert (tokens, sent, stopped) == expected, (trial, cut, stops, include)
            compared += 1
    assert compared > 100 and refused < compared
