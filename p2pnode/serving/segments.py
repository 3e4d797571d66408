"""A request's segments at the node: checked and found in its tokens at admission, carried to the serving node, laid
out there (exact mode) or handed to the engine (approximate mode). docs/segments.md tells the whole story.

Errors name the field the way the proto spells it (``segments[2].text``), like every other admission check.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from p2pnode.cache.namespace import DEFAULT_NAMESPACE, CacheNamespace
from p2pnode.cache.prefix_index import PrefixIndex
from p2pnode.cache.segments import (
    FrequencySketch,
    Layout,
    SegmentReuse,
    SegmentSpans,
    exact_layout,
    find_span,
    segment_key,
)
from p2pnode.config import MAX_SEGMENT_RECOMPUTE_TOKENS, MAX_SEGMENTS, SEGMENT_SKETCH_KEYS
from p2pnode.engine.base import SegmentOutcome
from p2pnode.serving.errors import ServeCode, ServeError
from p2pnode.v1 import node_pb2

__all__ = ["PROTO_MODES", "SegmentLayouts", "check_mode", "invalid", "resolve", "spans_of", "use_message"]


_MODES = {
    node_pb2.SEGMENT_REUSE_EXACT: SegmentReuse.EXACT,
    node_pb2.SEGMENT_REUSE_APPROXIMATE: SegmentReuse.APPROXIMATE,
}
PROTO_MODES = {mode: value for value, mode in _MODES.items()}


def invalid(field: str, message: str) -> ServeError:
    return ServeError(ServeCode.INVALID_ARGUMENT, f"{field}: {message}", field)


def check_mode(reuse: int, recompute: int, count: int) -> SegmentReuse | None:
    if not count:
        if reuse != node_pb2.SEGMENT_REUSE_UNSPECIFIED:
            raise invalid("segments", "a segment_reuse mode needs at least one segment")
        return None
    if count > MAX_SEGMENTS:
        raise invalid("segments", f"at most {MAX_SEGMENTS} segments per request, got {count}")
    mode = _MODES.get(reuse)
    if mode is None:
        raise invalid("segment_reuse", "must be SEGMENT_REUSE_EXACT or SEGMENT_REUSE_APPROXIMATE with segments")
    if recompute > MAX_SEGMENT_RECOMPUTE_TOKENS:
        raise invalid("segment_recompute_tokens", f"at most {MAX_SEGMENT_RECOMPUTE_TOKENS} tokens, got {recompute}")
    if recompute and mode is not SegmentReuse.APPROXIMATE:
        raise invalid("segment_recompute_tokens", "applies to SEGMENT_REUSE_APPROXIMATE only")
    return mode


def spans_of(
    mode: SegmentReuse,
    tokens: Sequence[int],
    spans: list[tuple[int, int]],
    recompute: int,
    namespace: CacheNamespace,
) -> SegmentSpans:
    keys = tuple(segment_key(namespace.label, tokens[s:e]) for s, e in spans)
    return SegmentSpans(mode, tuple(spans), keys, recompute)


def resolve(
    request: node_pb2.GenerateRequest,
    tokens: Sequence[int],
    encode: Callable[[str], list[int]],
    namespace: CacheNamespace = DEFAULT_NAMESPACE,
) -> SegmentSpans | None:
    """The request's segments as spans of ``tokens`` (its tokenized prompt), in order; None without segments.
    A text segment is tokenized alone and found after the previous segment (``cache/segments.find_span``)."""
    mode = check_mode(request.segment_reuse, request.segment_recompute_tokens, len(request.segments))
    if mode is None:
        return None
    spans: list[tuple[int, int]] = []
    after = 0
    for i, segment in enumerate(request.segments):
        kind = segment.WhichOneof("span")
        if kind == "text":
            if not segment.text:
                raise invalid(f"segments[{i}].text", "must not be empty")
            found = find_span(tokens, encode(segment.text), after)
            if found is None:
                where = f"after segments[{i - 1}]" if i else "in the prompt"
                raise invalid(f"segments[{i}].text", f"not found {where} (segments are given in prompt order)")
            start, end = found
        elif kind == "tokens":
            start, end = segment.tokens.start, segment.tokens.end
            if not start < end <= len(tokens):
                raise invalid(
                    f"segments[{i}].tokens", f"[{start}, {end}) is not a token range of the {len(tokens)}-token prompt"
                )
            if start < after:
                raise invalid(f"segments[{i}].tokens", f"starts at {start}, inside or before the previous segment")
        else:
            raise invalid(f"segments[{i}]", "set either text or tokens")
        spans.append((start, end))
        after = end
    return spans_of(mode, tokens, spans, request.segment_recompute_tokens, namespace)


class SegmentLayouts:
    """Exact mode on the serving node: lays prompts out against its own prefix index, and counts how often it sees
    each segment (the order of the segments its cache does not hold yet)."""

    def __init__(self, index: PrefixIndex, bos_token_id: int | None, sketch_keys: int = SEGMENT_SKETCH_KEYS) -> None:
        self.index = index
        self.bos_token_id = bos_token_id
        self.seen = FrequencySketch(sketch_keys)
        self.heads = FrequencySketch(sketch_keys)  # how often each segment was laid out first

    def layout(
        self, tokens: Sequence[int], segments: SegmentSpans, namespace: CacheNamespace = DEFAULT_NAMESPACE
    ) -> Layout:
        head = 1 if tokens and tokens[0] == self.bos_token_id and segments.spans[0][0] >= 1 else 0
        lead = segments.spans[0][0]
        # the text before the first segment (a system prompt), counted by its first block like a segment: kept in
        # front when that recurs (the prefix it would share), whatever follows it
        first_block = tokens[head : min(lead, head + self.index.block_size)]
        lead_key = segment_key(namespace.label, first_block) if lead > head else None
        layout = exact_layout(
            tokens,
            segments.spans,
            segments.keys,
            lambda candidate: self.index.match(candidate, namespace),
            self.seen.__getitem__,
            head=head,
            block_size=self.index.block_size,
            lead_key=lead_key,
            head_frequency=self.heads.__getitem__,
        )
        self.seen.observe(segments.keys if lead_key is None else (*segments.keys, lead_key))
        if layout.segments_first:
            self.heads.observe((segments.keys[layout.order[0]],))
        return layout


def use_message(segments: SegmentSpans, layout: Layout | None, outcome: SegmentOutcome | None) -> node_pb2.SegmentUse:
    """The final message's account of segment reuse."""
    use = node_pb2.SegmentUse(mode=PROTO_MODES[segments.mode], segments=len(segments.spans))
    if layout is not None:
        use.order.extend(layout.order)
    if outcome is not None:
        use.reused_segments = outcome.segments
        use.reused_tokens = outcome.loaded_tokens
        use.phases = outcome.phases
        use.error = outcome.error
    return use
