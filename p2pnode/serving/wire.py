"""A request's wire form between nodes: one function each way.

``to_forward`` writes a ``Request`` as the ``ForwardRequest`` its ingress seals for the serving peer; the peer's
admission checks every field again (``Admission.forwarded``) and ``request_of`` rebuilds the same ``Request`` from the
checked values. Sampling travels with every field set (``sampling_to_proto``), so the peer's checks fill nothing
from defaults: the engine there sees exactly the options the ingress admitted.
"""

from __future__ import annotations

from p2pnode.cache.namespace import CacheNamespace
from p2pnode.request import KvSource, Request, SamplingOptions
from p2pnode.serving import segments as segment_checks
from p2pnode.v1 import forward_pb2, node_pb2

__all__ = ["request_of", "sampling_to_proto", "to_forward"]


def to_forward(request: Request, origin: str) -> forward_pb2.ForwardRequest:
    """``request`` as ``origin`` forwards it (one hop: the peer serves it, never forwards it again)."""
    source = request.kv_source
    message = forward_pb2.ForwardRequest(
        request_id=request.request_id,
        prompt_token_ids=request.tokens,
        sampling=sampling_to_proto(request.sampling),
        origin=origin,
        hop=1,
        routing_key=request.routing_key,
        pull=(
            None if source is None
            else forward_pb2.KvPullHint(holder=source.holder, holder_address=source.address, blocks=source.blocks)
        ),
        adapter=request.namespace.adapter,
        cache_salt=request.namespace.salt,
    )
    segment_checks.to_forward(request.segments, message)
    return message


def request_of(
    message: forward_pb2.ForwardRequest,
    tokens: list[int],
    sampling: SamplingOptions,
    namespace: CacheNamespace,
    arrived: float,
) -> Request:
    """The forwarded ``Request``, from ``message`` and the values admission checked (its segments checked here)."""
    pull = message.pull if message.HasField("pull") else None
    return Request(
        request_id=message.request_id,
        tokens=tokens,
        sampling=sampling,
        namespace=namespace,
        segments=segment_checks.from_forward(message, tokens, namespace),
        routing_key=message.routing_key,
        arrived=arrived,
        origin=message.origin,
        kv_source=None if pull is None else KvSource(pull.holder, pull.holder_address, pull.blocks),
    )


def sampling_to_proto(options: SamplingOptions) -> node_pb2.SamplingParams:
    """Validated options on the wire, every field set (a peer's checks then fill nothing from defaults)."""
    sampling = node_pb2.SamplingParams(
        max_tokens=options.max_tokens,
        temperature=options.temperature,
        top_p=options.top_p,
        top_k=options.top_k,
        stop=list(options.stop),
        ignore_eos=options.ignore_eos,
        presence_penalty=options.presence_penalty,
        frequency_penalty=options.frequency_penalty,
        repetition_penalty=options.repetition_penalty,
        min_tokens=options.min_tokens,
        min_p=options.min_p,
        stop_token_ids=options.stop_token_ids,
        include_stop_str_in_output=options.include_stop_str_in_output,
        logit_bias=dict(options.logit_bias),
        structured_outputs=options.structured_outputs,
        priority=options.priority,
    )
    if options.seed is not None:
        sampling.seed = options.seed
    if options.logprobs is not None:
        sampling.logprobs = options.logprobs
    if options.prompt_logprobs is not None:
        sampling.prompt_logprobs = options.prompt_logprobs
    return sampling
