from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SegmentReuse(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SEGMENT_REUSE_UNSPECIFIED: _ClassVar[SegmentReuse]
    SEGMENT_REUSE_EXACT: _ClassVar[SegmentReuse]
    SEGMENT_REUSE_APPROXIMATE: _ClassVar[SegmentReuse]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
SEGMENT_REUSE_UNSPECIFIED: SegmentReuse
SEGMENT_REUSE_EXACT: SegmentReuse
SEGMENT_REUSE_APPROXIMATE: SegmentReuse
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "ignore_eos", "logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens", "min_p", "stop_token_ids", "include_stop_str_in_output", "logit_bias", "prompt_logprobs", "structured_outputs", "priority")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    ignore_eos: bool
    logprobs: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    min_tokens: int
    min_p: float
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    include_stop_str_in_output: bool
    logit_bias: _containers.ScalarMap[int, float]
    prompt_logprobs: int
    structured_outputs: str
    priority: int
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., min_tokens: _Optional[int] = ..., min_p: _Optional[float] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., include_stop_str_in_output: _Optional[bool] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., prompt_logprobs: _Optional[int] = ..., structured_outputs: _Optional[str] = ..., priority: _Optional[int] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "sampling", "routing_key", "n", "user", "model", "segments", "segment_reuse", "segment_recompute_tokens", "cache_salt")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    ROUTING_KEY_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    USER_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_REUSE_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_RECOMPUTE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: TokenIds
    sampling: SamplingParams
    routing_key: str
    n: int
    user: str
    model: str
    segments: _containers.RepeatedCompositeFieldContainer[Segment]
    segment_reuse: SegmentReuse
    segment_recompute_tokens: int
    cache_salt: str
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., routing_key: _Optional[str] = ..., n: _Optional[int] = ..., user: _Optional[str] = ..., model: _Optional[str] = ..., segments: _Optional[_Iterable[_Union[Segment, _Mapping]]] = ..., segment_reuse: _Optional[_Union[SegmentReuse, str]] = ..., segment_recompute_tokens: _Optional[int] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class Segment(_message.Message):
    __slots__ = ("text", "tokens")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    text: str
    tokens: TokenRange
    def __init__(self, text: _Optional[str] = ..., tokens: _Optional[_Union[TokenRange, _Mapping]] = ...) -> None: ...

class TokenRange(_message.Message):
    __slots__ = ("start", "end")
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    start: int
    end: int
    def __init__(self, start: _Optional[int] = ..., end: _Optional[int] = ...) -> None: ...

class SegmentUse(_message.Message):
    __slots__ = ("mode", "segments", "reused_segments", "reused_tokens", "order", "phases", "error")
    MODE_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    REUSED_SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    REUSED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ORDER_FIELD_NUMBER: _ClassVar[int]
    PHASES_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    mode: SegmentReuse
    segments: int
    reused_segments: int
    reused_tokens: int
    order: _containers.RepeatedScalarFieldContainer[int]
    phases: int
    error: str
    def __init__(self, mode: _Optional[_Union[SegmentReuse, str]] = ..., segments: _Optional[int] = ..., reused_segments: _Optional[int] = ..., reused_tokens: _Optional[int] = ..., order: _Optional[_Iterable[int]] = ..., phases: _Optional[int] = ..., error: _Optional[str] = ...) -> None: ...

class Timings(_message.Message):
    __slots__ = ("queue_s", "ttft_s", "total_s")
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    TTFT_S_FIELD_NUMBER: _ClassVar[int]
    TOTAL_S_FIELD_NUMBER: _ClassVar[int]
    queue_s: float
    ttft_s: float
    total_s: float
    def __init__(self, queue_s: _Optional[float] = ..., ttft_s: _Optional[float] = ..., total_s: _Optional[float] = ...) -> None: ...

class GenerateFinal(_message.Message):
    __slots__ = ("request_id", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens", "served_by", "index_match_tokens", "timings", "stop_reason", "ingress", "policy", "estimated_match_tokens", "attempts", "plan_epoch", "plan_planner", "plan_destinations", "pull", "segments", "segment_pulls", "tier_hits", "migrations")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SERVED_BY_FIELD_NUMBER: _ClassVar[int]
    INDEX_MATCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    INGRESS_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    ESTIMATED_MATCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    PLAN_EPOCH_FIELD_NUMBER: _ClassVar[int]
    PLAN_PLANNER_FIELD_NUMBER: _ClassVar[int]
    PLAN_DESTINATIONS_FIELD_NUMBER: _ClassVar[int]
    PULL_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_PULLS_FIELD_NUMBER: _ClassVar[int]
    TIER_HITS_FIELD_NUMBER: _ClassVar[int]
    MIGRATIONS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    served_by: str
    index_match_tokens: int
    timings: Timings
    stop_reason: str
    ingress: str
    policy: str
    estimated_match_tokens: int
    attempts: int
    plan_epoch: int
    plan_planner: str
    plan_destinations: _containers.RepeatedScalarFieldContainer[str]
    pull: KvPull
    segments: SegmentUse
    segment_pulls: _containers.RepeatedCompositeFieldContainer[KvPull]
    tier_hits: TierHits
    migrations: int
    def __init__(self, request_id: _Optional[str] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., served_by: _Optional[str] = ..., index_match_tokens: _Optional[int] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ..., stop_reason: _Optional[str] = ..., ingress: _Optional[str] = ..., policy: _Optional[str] = ..., estimated_match_tokens: _Optional[int] = ..., attempts: _Optional[int] = ..., plan_epoch: _Optional[int] = ..., plan_planner: _Optional[str] = ..., plan_destinations: _Optional[_Iterable[str]] = ..., pull: _Optional[_Union[KvPull, _Mapping]] = ..., segments: _Optional[_Union[SegmentUse, _Mapping]] = ..., segment_pulls: _Optional[_Iterable[_Union[KvPull, _Mapping]]] = ..., tier_hits: _Optional[_Union[TierHits, _Mapping]] = ..., migrations: _Optional[int] = ...) -> None: ...

class TierHits(_message.Message):
    __slots__ = ("gpu", "host", "disk", "pulled")
    GPU_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    DISK_FIELD_NUMBER: _ClassVar[int]
    PULLED_FIELD_NUMBER: _ClassVar[int]
    gpu: int
    host: int
    disk: int
    pulled: int
    def __init__(self, gpu: _Optional[int] = ..., host: _Optional[int] = ..., disk: _Optional[int] = ..., pulled: _Optional[int] = ...) -> None: ...

class KvStatus(_message.Message):
    __slots__ = ("layout", "block_server", "link_gbps", "pulls", "pulled_tokens", "pulled_bytes", "exports")
    class PullsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class ExportsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SERVER_FIELD_NUMBER: _ClassVar[int]
    LINK_GBPS_FIELD_NUMBER: _ClassVar[int]
    PULLS_FIELD_NUMBER: _ClassVar[int]
    PULLED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PULLED_BYTES_FIELD_NUMBER: _ClassVar[int]
    EXPORTS_FIELD_NUMBER: _ClassVar[int]
    layout: str
    block_server: str
    link_gbps: float
    pulls: _containers.ScalarMap[str, int]
    pulled_tokens: int
    pulled_bytes: int
    exports: _containers.ScalarMap[str, int]
    def __init__(self, layout: _Optional[str] = ..., block_server: _Optional[str] = ..., link_gbps: _Optional[float] = ..., pulls: _Optional[_Mapping[str, int]] = ..., pulled_tokens: _Optional[int] = ..., pulled_bytes: _Optional[int] = ..., exports: _Optional[_Mapping[str, int]] = ...) -> None: ...

class TierStatus(_message.Message):
    __slots__ = ("host_bytes", "host_blocks", "host_used_bytes", "host_indexed_blocks", "stored_blocks", "evicted_blocks", "store_failures", "loads", "loaded_tokens", "load_bytes", "load_seconds", "store_bytes", "store_seconds", "exports", "export_blocks", "store_threshold", "store_outputs", "eviction", "disk_bytes", "disk_blocks", "disk_load_bytes", "disk_store_bytes", "disk_failures")
    HOST_BYTES_FIELD_NUMBER: _ClassVar[int]
    HOST_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HOST_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    HOST_INDEXED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    STORED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    EVICTED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    STORE_FAILURES_FIELD_NUMBER: _ClassVar[int]
    LOADS_FIELD_NUMBER: _ClassVar[int]
    LOADED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    LOAD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    STORE_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    EXPORTS_FIELD_NUMBER: _ClassVar[int]
    EXPORT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    STORE_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    STORE_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    EVICTION_FIELD_NUMBER: _ClassVar[int]
    DISK_BYTES_FIELD_NUMBER: _ClassVar[int]
    DISK_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DISK_LOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    DISK_STORE_BYTES_FIELD_NUMBER: _ClassVar[int]
    DISK_FAILURES_FIELD_NUMBER: _ClassVar[int]
    host_bytes: int
    host_blocks: int
    host_used_bytes: int
    host_indexed_blocks: int
    stored_blocks: int
    evicted_blocks: int
    store_failures: int
    loads: int
    loaded_tokens: int
    load_bytes: int
    load_seconds: float
    store_bytes: int
    store_seconds: float
    exports: int
    export_blocks: int
    store_threshold: int
    store_outputs: bool
    eviction: str
    disk_bytes: int
    disk_blocks: int
    disk_load_bytes: int
    disk_store_bytes: int
    disk_failures: int
    def __init__(self, host_bytes: _Optional[int] = ..., host_blocks: _Optional[int] = ..., host_used_bytes: _Optional[int] = ..., host_indexed_blocks: _Optional[int] = ..., stored_blocks: _Optional[int] = ..., evicted_blocks: _Optional[int] = ..., store_failures: _Optional[int] = ..., loads: _Optional[int] = ..., loaded_tokens: _Optional[int] = ..., load_bytes: _Optional[int] = ..., load_seconds: _Optional[float] = ..., store_bytes: _Optional[int] = ..., store_seconds: _Optional[float] = ..., exports: _Optional[int] = ..., export_blocks: _Optional[int] = ..., store_threshold: _Optional[int] = ..., store_outputs: _Optional[bool] = ..., eviction: _Optional[str] = ..., disk_bytes: _Optional[int] = ..., disk_blocks: _Optional[int] = ..., disk_load_bytes: _Optional[int] = ..., disk_store_bytes: _Optional[int] = ..., disk_failures: _Optional[int] = ...) -> None: ...

class SegmentStatus(_message.Message):
    __slots__ = ("store_bytes", "held_segments", "held_tokens", "requests", "reused_tokens", "loaded_segments", "phases")
    class RequestsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class ReusedTokensEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    STORE_BYTES_FIELD_NUMBER: _ClassVar[int]
    HELD_SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    HELD_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    REUSED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOADED_SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    PHASES_FIELD_NUMBER: _ClassVar[int]
    store_bytes: int
    held_segments: int
    held_tokens: int
    requests: _containers.ScalarMap[str, int]
    reused_tokens: _containers.ScalarMap[str, int]
    loaded_segments: int
    phases: int
    def __init__(self, store_bytes: _Optional[int] = ..., held_segments: _Optional[int] = ..., held_tokens: _Optional[int] = ..., requests: _Optional[_Mapping[str, int]] = ..., reused_tokens: _Optional[_Mapping[str, int]] = ..., loaded_segments: _Optional[int] = ..., phases: _Optional[int] = ...) -> None: ...

class KvPull(_message.Message):
    __slots__ = ("holder", "outcome", "tokens", "bytes", "seconds")
    HOLDER_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    holder: str
    outcome: str
    tokens: int
    bytes: int
    seconds: float
    def __init__(self, holder: _Optional[str] = ..., outcome: _Optional[str] = ..., tokens: _Optional[int] = ..., bytes: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "token", "rank")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    token: str
    rank: int
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., token: _Optional[str] = ..., rank: _Optional[int] = ...) -> None: ...

class PositionLogprobs(_message.Message):
    __slots__ = ("sampled", "top")
    SAMPLED_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    sampled: TokenLogprob
    top: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, sampled: _Optional[_Union[TokenLogprob, _Mapping]] = ..., top: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("token_ids", "text", "final", "logprobs", "index", "prompt_logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    final: GenerateFinal
    logprobs: _containers.RepeatedCompositeFieldContainer[PositionLogprobs]
    index: int
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[PositionLogprobs]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., final: _Optional[_Union[GenerateFinal, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[PositionLogprobs, _Mapping]]] = ..., index: _Optional[int] = ..., prompt_logprobs: _Optional[_Iterable[_Union[PositionLogprobs, _Mapping]]] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EngineLoad(_message.Message):
    __slots__ = ("running", "waiting", "kv_usage", "in_flight", "engine_unfinished", "healthy", "prefix_cache_hit_rate", "kv_cached", "queued", "stalled_s")
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_USAGE_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    ENGINE_UNFINISHED_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    KV_CACHED_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    STALLED_S_FIELD_NUMBER: _ClassVar[int]
    running: int
    waiting: int
    kv_usage: float
    in_flight: int
    engine_unfinished: int
    healthy: bool
    prefix_cache_hit_rate: float
    kv_cached: float
    queued: int
    stalled_s: float
    def __init__(self, running: _Optional[int] = ..., waiting: _Optional[int] = ..., kv_usage: _Optional[float] = ..., in_flight: _Optional[int] = ..., engine_unfinished: _Optional[int] = ..., healthy: _Optional[bool] = ..., prefix_cache_hit_rate: _Optional[float] = ..., kv_cached: _Optional[float] = ..., queued: _Optional[int] = ..., stalled_s: _Optional[float] = ...) -> None: ...

class IndexStatus(_message.Message):
    __slots__ = ("blocks", "approx_bytes", "max_blocks", "stored_blocks_total", "removed_blocks_total", "orphaned_blocks", "unknown_removals", "overflow_evictions", "resets", "version", "summary_version")
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    APPROX_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    STORED_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    REMOVED_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    ORPHANED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    UNKNOWN_REMOVALS_FIELD_NUMBER: _ClassVar[int]
    OVERFLOW_EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    RESETS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_VERSION_FIELD_NUMBER: _ClassVar[int]
    blocks: int
    approx_bytes: int
    max_blocks: int
    stored_blocks_total: int
    removed_blocks_total: int
    orphaned_blocks: int
    unknown_removals: int
    overflow_evictions: int
    resets: int
    version: int
    summary_version: int
    def __init__(self, blocks: _Optional[int] = ..., approx_bytes: _Optional[int] = ..., max_blocks: _Optional[int] = ..., stored_blocks_total: _Optional[int] = ..., removed_blocks_total: _Optional[int] = ..., orphaned_blocks: _Optional[int] = ..., unknown_removals: _Optional[int] = ..., overflow_evictions: _Optional[int] = ..., resets: _Optional[int] = ..., version: _Optional[int] = ..., summary_version: _Optional[int] = ...) -> None: ...

class KvEventStatus(_message.Message):
    __slots__ = ("batches", "events", "decode_errors", "gaps", "replayed_batches", "unrecovered_gaps", "resets", "last_seq")
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    DECODE_ERRORS_FIELD_NUMBER: _ClassVar[int]
    GAPS_FIELD_NUMBER: _ClassVar[int]
    REPLAYED_BATCHES_FIELD_NUMBER: _ClassVar[int]
    UNRECOVERED_GAPS_FIELD_NUMBER: _ClassVar[int]
    RESETS_FIELD_NUMBER: _ClassVar[int]
    LAST_SEQ_FIELD_NUMBER: _ClassVar[int]
    batches: int
    events: int
    decode_errors: int
    gaps: int
    replayed_batches: int
    unrecovered_gaps: int
    resets: int
    last_seq: int
    def __init__(self, batches: _Optional[int] = ..., events: _Optional[int] = ..., decode_errors: _Optional[int] = ..., gaps: _Optional[int] = ..., replayed_batches: _Optional[int] = ..., unrecovered_gaps: _Optional[int] = ..., resets: _Optional[int] = ..., last_seq: _Optional[int] = ...) -> None: ...

class RoutingStatus(_message.Message):
    __slots__ = ("policy", "decisions", "served_locally", "forwarded", "retries", "served", "estimated_cached_tokens", "engine_cached_tokens", "estimate_abs_error_tokens", "relays_in_flight", "forwards_received", "migrations", "peer_links", "peer_links_opened")
    POLICY_FIELD_NUMBER: _ClassVar[int]
    DECISIONS_FIELD_NUMBER: _ClassVar[int]
    SERVED_LOCALLY_FIELD_NUMBER: _ClassVar[int]
    FORWARDED_FIELD_NUMBER: _ClassVar[int]
    RETRIES_FIELD_NUMBER: _ClassVar[int]
    SERVED_FIELD_NUMBER: _ClassVar[int]
    ESTIMATED_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ESTIMATE_ABS_ERROR_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RELAYS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    FORWARDS_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    MIGRATIONS_FIELD_NUMBER: _ClassVar[int]
    PEER_LINKS_FIELD_NUMBER: _ClassVar[int]
    PEER_LINKS_OPENED_FIELD_NUMBER: _ClassVar[int]
    policy: str
    decisions: int
    served_locally: int
    forwarded: int
    retries: int
    served: int
    estimated_cached_tokens: int
    engine_cached_tokens: int
    estimate_abs_error_tokens: int
    relays_in_flight: int
    forwards_received: int
    migrations: int
    peer_links: int
    peer_links_opened: int
    def __init__(self, policy: _Optional[str] = ..., decisions: _Optional[int] = ..., served_locally: _Optional[int] = ..., forwarded: _Optional[int] = ..., retries: _Optional[int] = ..., served: _Optional[int] = ..., estimated_cached_tokens: _Optional[int] = ..., engine_cached_tokens: _Optional[int] = ..., estimate_abs_error_tokens: _Optional[int] = ..., relays_in_flight: _Optional[int] = ..., forwards_received: _Optional[int] = ..., migrations: _Optional[int] = ..., peer_links: _Optional[int] = ..., peer_links_opened: _Optional[int] = ...) -> None: ...

class MemberStatus(_message.Message):
    __slots__ = ("node_id", "address", "state", "generation", "heartbeat", "info_age_s", "phi", "running", "waiting", "kv_usage", "in_flight", "summary_hashes", "is_self", "adapters", "prefix_cache_hit_rate", "kv_cached", "version", "engine_version", "served_model_names", "summary_segments")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    INFO_AGE_S_FIELD_NUMBER: _ClassVar[int]
    PHI_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_USAGE_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_HASHES_FIELD_NUMBER: _ClassVar[int]
    IS_SELF_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    KV_CACHED_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ENGINE_VERSION_FIELD_NUMBER: _ClassVar[int]
    SERVED_MODEL_NAMES_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    address: str
    state: str
    generation: int
    heartbeat: int
    info_age_s: float
    phi: float
    running: int
    waiting: int
    kv_usage: float
    in_flight: int
    summary_hashes: int
    is_self: bool
    adapters: _containers.RepeatedScalarFieldContainer[str]
    prefix_cache_hit_rate: float
    kv_cached: float
    version: str
    engine_version: str
    served_model_names: _containers.RepeatedScalarFieldContainer[str]
    summary_segments: int
    def __init__(self, node_id: _Optional[str] = ..., address: _Optional[str] = ..., state: _Optional[str] = ..., generation: _Optional[int] = ..., heartbeat: _Optional[int] = ..., info_age_s: _Optional[float] = ..., phi: _Optional[float] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., kv_usage: _Optional[float] = ..., in_flight: _Optional[int] = ..., summary_hashes: _Optional[int] = ..., is_self: _Optional[bool] = ..., adapters: _Optional[_Iterable[str]] = ..., prefix_cache_hit_rate: _Optional[float] = ..., kv_cached: _Optional[float] = ..., version: _Optional[str] = ..., engine_version: _Optional[str] = ..., served_model_names: _Optional[_Iterable[str]] = ..., summary_segments: _Optional[int] = ...) -> None: ...

class EvictionStatus(_message.Message):
    __slots__ = ("policy", "active", "shadow_hit_rates", "observed_requests", "sampled_requests", "switches", "sample_rate", "shadow_blocks")
    class ShadowHitRatesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    POLICY_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_FIELD_NUMBER: _ClassVar[int]
    SHADOW_HIT_RATES_FIELD_NUMBER: _ClassVar[int]
    OBSERVED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    SWITCHES_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_RATE_FIELD_NUMBER: _ClassVar[int]
    SHADOW_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    policy: str
    active: str
    shadow_hit_rates: _containers.ScalarMap[str, float]
    observed_requests: int
    sampled_requests: int
    switches: int
    sample_rate: float
    shadow_blocks: int
    def __init__(self, policy: _Optional[str] = ..., active: _Optional[str] = ..., shadow_hit_rates: _Optional[_Mapping[str, float]] = ..., observed_requests: _Optional[int] = ..., sampled_requests: _Optional[int] = ..., switches: _Optional[int] = ..., sample_rate: _Optional[float] = ..., shadow_blocks: _Optional[int] = ...) -> None: ...

class PlanStatus(_message.Message):
    __slots__ = ("planner", "epoch", "built_by", "warm_keys", "destinations", "expected_imbalance", "affinity", "cache_churn", "count_churn", "plans_built", "plans_adopted", "tracked_keys", "gate", "gate_requests", "gate_plan_kv_hit", "gate_flat_kv_hit", "gate_plan_p99_ttft_s", "gate_flat_p99_ttft_s", "warm", "gate_age_s", "prefill_token_cost", "decode_token_cost", "loads", "last_score", "plans_scored", "mean_imbalance_error")
    PLANNER_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    BUILT_BY_FIELD_NUMBER: _ClassVar[int]
    WARM_KEYS_FIELD_NUMBER: _ClassVar[int]
    DESTINATIONS_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_IMBALANCE_FIELD_NUMBER: _ClassVar[int]
    AFFINITY_FIELD_NUMBER: _ClassVar[int]
    CACHE_CHURN_FIELD_NUMBER: _ClassVar[int]
    COUNT_CHURN_FIELD_NUMBER: _ClassVar[int]
    PLANS_BUILT_FIELD_NUMBER: _ClassVar[int]
    PLANS_ADOPTED_FIELD_NUMBER: _ClassVar[int]
    TRACKED_KEYS_FIELD_NUMBER: _ClassVar[int]
    GATE_FIELD_NUMBER: _ClassVar[int]
    GATE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    GATE_PLAN_KV_HIT_FIELD_NUMBER: _ClassVar[int]
    GATE_FLAT_KV_HIT_FIELD_NUMBER: _ClassVar[int]
    GATE_PLAN_P99_TTFT_S_FIELD_NUMBER: _ClassVar[int]
    GATE_FLAT_P99_TTFT_S_FIELD_NUMBER: _ClassVar[int]
    WARM_FIELD_NUMBER: _ClassVar[int]
    GATE_AGE_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKEN_COST_FIELD_NUMBER: _ClassVar[int]
    DECODE_TOKEN_COST_FIELD_NUMBER: _ClassVar[int]
    LOADS_FIELD_NUMBER: _ClassVar[int]
    LAST_SCORE_FIELD_NUMBER: _ClassVar[int]
    PLANS_SCORED_FIELD_NUMBER: _ClassVar[int]
    MEAN_IMBALANCE_ERROR_FIELD_NUMBER: _ClassVar[int]
    planner: str
    epoch: int
    built_by: str
    warm_keys: int
    destinations: int
    expected_imbalance: float
    affinity: bool
    cache_churn: float
    count_churn: float
    plans_built: int
    plans_adopted: int
    tracked_keys: int
    gate: str
    gate_requests: int
    gate_plan_kv_hit: float
    gate_flat_kv_hit: float
    gate_plan_p99_ttft_s: float
    gate_flat_p99_ttft_s: float
    warm: _containers.RepeatedCompositeFieldContainer[WarmKey]
    gate_age_s: float
    prefill_token_cost: float
    decode_token_cost: float
    loads: _containers.RepeatedCompositeFieldContainer[DestinationLoad]
    last_score: PlanScore
    plans_scored: int
    mean_imbalance_error: float
    def __init__(self, planner: _Optional[str] = ..., epoch: _Optional[int] = ..., built_by: _Optional[str] = ..., warm_keys: _Optional[int] = ..., destinations: _Optional[int] = ..., expected_imbalance: _Optional[float] = ..., affinity: _Optional[bool] = ..., cache_churn: _Optional[float] = ..., count_churn: _Optional[float] = ..., plans_built: _Optional[int] = ..., plans_adopted: _Optional[int] = ..., tracked_keys: _Optional[int] = ..., gate: _Optional[str] = ..., gate_requests: _Optional[int] = ..., gate_plan_kv_hit: _Optional[float] = ..., gate_flat_kv_hit: _Optional[float] = ..., gate_plan_p99_ttft_s: _Optional[float] = ..., gate_flat_p99_ttft_s: _Optional[float] = ..., warm: _Optional[_Iterable[_Union[WarmKey, _Mapping]]] = ..., gate_age_s: _Optional[float] = ..., prefill_token_cost: _Optional[float] = ..., decode_token_cost: _Optional[float] = ..., loads: _Optional[_Iterable[_Union[DestinationLoad, _Mapping]]] = ..., last_score: _Optional[_Union[PlanScore, _Mapping]] = ..., plans_scored: _Optional[int] = ..., mean_imbalance_error: _Optional[float] = ...) -> None: ...

class DestinationLoad(_message.Message):
    __slots__ = ("node_id", "expected", "served")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_FIELD_NUMBER: _ClassVar[int]
    SERVED_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    expected: float
    served: float
    def __init__(self, node_id: _Optional[str] = ..., expected: _Optional[float] = ..., served: _Optional[float] = ...) -> None: ...

class PlanScore(_message.Message):
    __slots__ = ("epoch", "built_by", "seconds", "expected_imbalance", "served_imbalance", "expected_load", "served_load", "destinations", "period_imbalance")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    BUILT_BY_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_IMBALANCE_FIELD_NUMBER: _ClassVar[int]
    SERVED_IMBALANCE_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_LOAD_FIELD_NUMBER: _ClassVar[int]
    SERVED_LOAD_FIELD_NUMBER: _ClassVar[int]
    DESTINATIONS_FIELD_NUMBER: _ClassVar[int]
    PERIOD_IMBALANCE_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    built_by: str
    seconds: float
    expected_imbalance: float
    served_imbalance: float
    expected_load: float
    served_load: float
    destinations: _containers.RepeatedCompositeFieldContainer[DestinationLoad]
    period_imbalance: float
    def __init__(self, epoch: _Optional[int] = ..., built_by: _Optional[str] = ..., seconds: _Optional[float] = ..., expected_imbalance: _Optional[float] = ..., served_imbalance: _Optional[float] = ..., expected_load: _Optional[float] = ..., served_load: _Optional[float] = ..., destinations: _Optional[_Iterable[_Union[DestinationLoad, _Mapping]]] = ..., period_imbalance: _Optional[float] = ...) -> None: ...

class WarmKey(_message.Message):
    __slots__ = ("key", "kb", "destinations", "expected_load", "sent", "held_kb")
    KEY_FIELD_NUMBER: _ClassVar[int]
    KB_FIELD_NUMBER: _ClassVar[int]
    DESTINATIONS_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_LOAD_FIELD_NUMBER: _ClassVar[int]
    SENT_FIELD_NUMBER: _ClassVar[int]
    HELD_KB_FIELD_NUMBER: _ClassVar[int]
    key: str
    kb: int
    destinations: _containers.RepeatedScalarFieldContainer[str]
    expected_load: float
    sent: _containers.RepeatedScalarFieldContainer[int]
    held_kb: int
    def __init__(self, key: _Optional[str] = ..., kb: _Optional[int] = ..., destinations: _Optional[_Iterable[str]] = ..., expected_load: _Optional[float] = ..., sent: _Optional[_Iterable[int]] = ..., held_kb: _Optional[int] = ...) -> None: ...

class NodeStatus(_message.Message):
    __slots__ = ("node_id", "address", "model", "block_size", "max_model_len", "draining", "load", "index", "kv_events", "requests_total", "requests_failed", "requests_rejected", "requests_cancelled", "uptime_s", "routing", "members", "gossip_counters", "plan", "http_address", "requests_succeeded", "eviction", "kv", "segments", "adapters", "resident_adapters", "adapter_requests", "version", "engine_version", "served_model_names", "tier")
    class GossipCountersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class AdapterRequestsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FAILED_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_REJECTED_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_CANCELLED_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    ROUTING_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    GOSSIP_COUNTERS_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    HTTP_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_SUCCEEDED_FIELD_NUMBER: _ClassVar[int]
    EVICTION_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ENGINE_VERSION_FIELD_NUMBER: _ClassVar[int]
    SERVED_MODEL_NAMES_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    address: str
    model: str
    block_size: int
    max_model_len: int
    draining: bool
    load: EngineLoad
    index: IndexStatus
    kv_events: KvEventStatus
    requests_total: int
    requests_failed: int
    requests_rejected: int
    requests_cancelled: int
    uptime_s: float
    routing: RoutingStatus
    members: _containers.RepeatedCompositeFieldContainer[MemberStatus]
    gossip_counters: _containers.ScalarMap[str, int]
    plan: PlanStatus
    http_address: str
    requests_succeeded: int
    eviction: EvictionStatus
    kv: KvStatus
    segments: SegmentStatus
    adapters: _containers.RepeatedScalarFieldContainer[str]
    resident_adapters: _containers.RepeatedScalarFieldContainer[str]
    adapter_requests: _containers.ScalarMap[str, int]
    version: str
    engine_version: str
    served_model_names: _containers.RepeatedScalarFieldContainer[str]
    tier: TierStatus
    def __init__(self, node_id: _Optional[str] = ..., address: _Optional[str] = ..., model: _Optional[str] = ..., block_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., draining: _Optional[bool] = ..., load: _Optional[_Union[EngineLoad, _Mapping]] = ..., index: _Optional[_Union[IndexStatus, _Mapping]] = ..., kv_events: _Optional[_Union[KvEventStatus, _Mapping]] = ..., requests_total: _Optional[int] = ..., requests_failed: _Optional[int] = ..., requests_rejected: _Optional[int] = ..., requests_cancelled: _Optional[int] = ..., uptime_s: _Optional[float] = ..., routing: _Optional[_Union[RoutingStatus, _Mapping]] = ..., members: _Optional[_Iterable[_Union[MemberStatus, _Mapping]]] = ..., gossip_counters: _Optional[_Mapping[str, int]] = ..., plan: _Optional[_Union[PlanStatus, _Mapping]] = ..., http_address: _Optional[str] = ..., requests_succeeded: _Optional[int] = ..., eviction: _Optional[_Union[EvictionStatus, _Mapping]] = ..., kv: _Optional[_Union[KvStatus, _Mapping]] = ..., segments: _Optional[_Union[SegmentStatus, _Mapping]] = ..., adapters: _Optional[_Iterable[str]] = ..., resident_adapters: _Optional[_Iterable[str]] = ..., adapter_requests: _Optional[_Mapping[str, int]] = ..., version: _Optional[str] = ..., engine_version: _Optional[str] = ..., served_model_names: _Optional[_Iterable[str]] = ..., tier: _Optional[_Union[TierStatus, _Mapping]] = ...) -> None: ...
