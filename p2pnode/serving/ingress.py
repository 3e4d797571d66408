"""The one ingress path of a node: admit -> route -> serve here or relay from a peer, for every client API.

The gRPC servicer (``api/grpc/node_service.py``) and the OpenAI-compatible HTTP front (``api/http/server.py``) are
thin adapters over it, so a request is admitted (``admission.py``), routed, retried, cancelled, drained, counted and
logged the same way whichever API it came through.

Invariants a client can rely on:
- a call ends with exactly one of: a message carrying ``final`` for each of its sequences, or one ``ServeError``
  whose ``code`` says why and whose message names the cause (and the field, for INVALID_ARGUMENT);
- output is never duplicated nor lost: another node is tried from the start only while a sequence has streamed
  nothing; after that a failure continues it on another node from the prompt and the tokens sent
  (``migration.py``, ``--migration-limit`` times), or is UNAVAILABLE and says how much partial output was sent;
- no call waits on a peer that cannot answer: a forwarded attempt is abandoned and the next node tried when its
  first token is late or gossip turns the peer suspect (``forward.py``), and peers that gossip does not fully trust
  (suspect, or never seen alive) are tried only after the others;
- closing the stream early (client gone, deadline) aborts the engine requests wherever they run;
- while the node drains, new calls get UNAVAILABLE and admitted calls finish.

``n`` sequences (gRPC ``n``; HTTP ``n`` times its prompts) are sibling requests through this same path, each
routed on its own: they share the prompt, so after the first the speculative index sends the rest to the same
node, and a whole call never needs a multi-sequence engine request, forward or retry protocol.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from p2pnode.config import ACCESS_LOG_REJECTED_BURST, MAX_REQUEST_ID_CHARS, NodeConfig
from p2pnode.flow.rate_limit import TenantRateLimits
from p2pnode.log_limit import LogLimiter
from p2pnode.request import KvSource, Request
from p2pnode.routing.policies.types import NoAliveCandidate
from p2pnode.routing.router import Route, Router
from p2pnode.serving.admission import Admission, Call
from p2pnode.serving.errors import ServeCode, ServeError, TargetFailed, Throttle
from p2pnode.serving.forward import ForwardClient
from p2pnode.serving.local import ActivityTracker, LocalServer
from p2pnode.serving.migration import Decode, StopSeam, TextSeam, continuation, not_resumable
from p2pnode.serving.tenant_usage import TenantUsage
from p2pnode.serving.tenants import DEFAULT_CALLER, Caller, Tenants
from p2pnode.v1 import node_pb2

log = logging.getLogger("p2pnode.api")
access_log = logging.getLogger("p2pnode.access")

#: Messages buffered between a call's sibling sequences and its client (n > 1): beyond it the siblings wait for
#: the client to read, so a slow reader holds back its engines instead of growing a queue.
MERGE_BUFFER_MESSAGES = 64

#: How a call ended; the label values of p2pnode:requests_total.
OUTCOMES = ("success", "rejected", "failed", "cancelled")


@dataclass
class RequestCounters:
    """Client calls by outcome (every call counts once in ``total`` and once in its outcome), and by API."""

    total: int = 0
    succeeded: int = 0
    failed: int = 0
    rejected: int = 0
    cancelled: int = 0
    by_api: Counter[tuple[str, str]] = field(default_factory=Counter)  # (api, outcome) -> calls
    #: Rejected calls by API and code (``ServeCode`` name): what their sampled access lines do not all show.
    rejected_by: Counter[tuple[str, str]] = field(default_factory=Counter)

    def count(self, api: str, outcome: str) -> None:
        self.total += 1
        attr = "succeeded" if outcome == "success" else outcome
        setattr(self, attr, getattr(self, attr) + 1)
        self.by_api[(api, outcome)] += 1


#: Called once per finished sequence: (api, path "local" | "forwarded", ingress TTFT s, end-to-end s).
SequenceObserver = Callable[[str, str, float, float], None]


@dataclass(frozen=True)
class IngressContext:
    """What an ingress needs from the node around it (every part optional: a standalone node has no mesh)."""

    #: The model names clients may ask for (empty: any).
    served_model_names: tuple[str, ...] = ()
    #: The LoRA adapters some node of the mesh serves (None: this node's engine's alone).
    mesh_adapters: Callable[[], frozenset[str]] | None = None
    #: Whether gossip fully trusts a peer (alive and seen alive); None: every peer is (no gossip).
    peer_trusted: Callable[[str], bool] | None = None
    #: Told of every finished sequence (the metrics' latency histograms).
    observer: SequenceObserver | None = None
    #: Called with each sequence's route and final message once it has been served (the rate plan counts it).
    on_served: Callable[[Route, node_pb2.GenerateFinal], None] | None = None
    #: Where the ingress counts its calls (the node's metrics read the same object).
    counters: RequestCounters = field(default_factory=lambda: RequestCounters())
    #: Who calls are for, and their rate limits (None: from the node's configuration).
    tenants: Tenants | None = None
    #: The tenants' rate-limit buckets (None: the ingress's own), and where admitted calls are counted for the
    #: mesh-wide limits (None: not counted: the node runs alone).
    limits: TenantRateLimits | None = None
    usage: TenantUsage | None = None


class Ingress:
    """Admits calls from any API, routes each sequence, and streams it from this node's engine or a peer."""

    def __init__(
        self,
        config: NodeConfig,
        local: LocalServer,
        router: Router,
        forwarder: ForwardClient | None,
        context: IngressContext | None = None,
    ) -> None:
        context = context or IngressContext()
        self.config = config
        self.node_id = config.node_id
        self.local = local
        self.engine = local.engine
        self.router = router
        self.forwarder = forwarder
        self.served_model_names = context.served_model_names
        self.counters = context.counters
        #: Sequences being routed or relayed, by request id: unique while they run; drain waits for none.
        self.relays = ActivityTracker()
        self.observer = context.observer
        self.on_served = context.on_served
        self.peer_trusted = context.peer_trusted
        #: The tenants calls are for (their names, weights and rate limits: ``tenants.py``).
        self.tenants = context.tenants if context.tenants is not None else Tenants(config.flow)
        #: Every check a call passes before it runs (``admission.py``), the tenants' rate limits last.
        self.admission = Admission(
            config, self.engine, context, self.relays, lambda: self.draining,
            limits=context.limits if context.limits is not None else TenantRateLimits(self.tenants.rate_limit),
            queue=local.queue, usage=context.usage,
        )
        #: A failing peer fails every request sent its way: a few lines a minute per peer and code, then a count.
        self._log = LogLimiter(log)
        #: Access lines of refused calls: a few per code and interval (``reject``).
        self._rejections = LogLimiter(access_log, burst=ACCESS_LOG_REJECTED_BURST)
        self._ids = itertools.count(1)
        self._id_prefix = f"{config.node_id}-{os.getpid()}-"

    @property
    def draining(self) -> bool:
        return self.local.draining

    def _new_call_id(self) -> str:
        """An id for a call whose client names none: unique to this node's process."""
        return f"{self._id_prefix}{next(self._ids)}"

    # --- admission --------------------------------------------------------------------------------------------

    async def admit(
        self,
        requests: list[node_pb2.GenerateRequest],
        api: str,
        *,
        deadline: float | None = None,
        caller: Caller = DEFAULT_CALLER,
    ) -> Call:
        """Admit a call for ``caller`` (one request per prompt, each with its ``n``: ``Admission.call``); raise
        ServeError.

        A rejected call is counted and logged here; an admitted one is counted when ``run`` ends.
        """
        arrived = time.monotonic()
        try:
            return await self.admission.call(requests, api, self._new_call_id, deadline, caller)
        except ServeError as e:
            self.reject(api, requests[0].request_id if requests else "", e, arrived)
            raise

    def reject(self, api: str, call_id: str, error: ServeError, arrived: float | None = None) -> None:
        """Count and log a call refused before it ran (the HTTP front calls it for its own refusals too).

        Refusals cost the client nothing to provoke, so their access lines are sampled: the first
        ACCESS_LOG_REJECTED_BURST of each code per interval (``_rejections``); every one is counted
        (``p2pnode:rejected_requests_total{api, code}``).
        """
        self.counters.count(api, "rejected")
        self.counters.rejected_by[(api, error.code.name)] += 1
        elapsed = time.monotonic() - arrived if arrived is not None else 0.0
        fields = {"total_ms": round(elapsed * 1e3, 2), "error": error.message}
        self._access(api, call_id or "-", error.code, fields, sample=f"{api}:{error.code.name}")

    # --- serving ----------------------------------------------------------------------------------------------

    async def run(self, call: Call) -> AsyncIterator[node_pb2.GenerateResponse]:
        """Stream the call's messages (each with its sequence ``index``); raise ServeError on failure.

        Close it (``contextlib.aclosing``) when the client goes away: every engine request still running is
        aborted, here or on the peer serving it.
        """
        outcome, code = "cancelled", ServeCode.CANCELLED
        for s in call.sequences:
            self.relays.begin(s.request_id)
        try:
            single = len(call.sequences) == 1
            source = self._sequence(call, call.sequences[0]) if single else self._merged(call)
            async with contextlib.aclosing(source) as messages:
                async for message in messages:
                    yield message
            outcome, code = "success", ServeCode.OK
        except ServeError as e:
            outcome, code = "failed", e.code
            self._finish(call, outcome, code, e.message)
            raise
        except Exception as e:  # a bug: the client gets INTERNAL (never a silent UNKNOWN), the log the traceback
            log.exception("request %s failed", call.call_id)
            outcome, code = "failed", ServeCode.INTERNAL
            error = ServeError(code, f"internal error serving the request: {type(e).__name__}")
            self._finish(call, outcome, code, error.message)
            raise error from e
        finally:
            for s in call.sequences:
                self.relays.end(s.request_id)
            if outcome != "failed":
                self._finish(call, outcome, code)

    def _source(self, target: str, route: Route, request: Request) -> AsyncIterator[node_pb2.GenerateResponse]:
        request = request.with_kv_source(self._kv_source(route, target))
        if target == self.node_id or self.forwarder is None:
            return self.local.stream(request)
        return self.forwarder.stream(target, route.addresses[target], request)

    @staticmethod
    def _kv_source(route: Route, target: str) -> KvSource | None:
        """The prefix ``target`` pulls before serving, when routing chose it to (a retry elsewhere computes it)."""
        pull = route.decision.pull
        if pull is None or pull.target != target or pull.holder == target or pull.holder not in route.addresses:
            return None
        return KvSource(pull.holder, route.addresses[pull.holder], pull.blocks)

    def _route(self, request: Request) -> Route:
        try:
            return self.router.route(request)
        except NoAliveCandidate as e:
            stalled_s = self.local.engine.status().stalled_s
            down = f"stalled: no step for {stalled_s:.0f} s" if stalled_s else "down"
            raise ServeError(ServeCode.UNAVAILABLE, f"no node can serve: {e} (this node's engine is {down})") from e

    async def _sequence(self, call: Call, request: Request) -> AsyncIterator[node_pb2.GenerateResponse]:
        """Route one sequence and stream it from the ranked candidates in turn: another node is tried only before any
        output; a node that fails after output is continued elsewhere (``migration.py``) up to ``--migration-limit``
        times, routed anew without the nodes that failed it."""
        progress = _Progress(call, request, self.engine.decode, self.config.routing.migration_limit)
        failed: set[str] = set()  # nodes that failed the sequence mid-stream: never asked to continue it
        retries, leg = 0, request
        while True:
            route = self._route(leg)
            call.policy = route.decision.policy
            ranked = tuple(t for t in route.decision.ranked if t not in failed)
            candidates = self._trusted_first(ranked)[: self.config.routing.max_attempts]
            failures: list[TargetFailed] = []
            continued: Request | None = None
            for tried, target in enumerate(candidates):
                if tried:  # a leg's first attempt (a continuation's included) is no retry
                    retries += 1
                    self.router.counters.retries += 1
                attempt = 1 + retries
                call.attempts[request.index] = attempt
                ticket = self.router.begin(route, target)
                answered = False
                try:
                    async with contextlib.aclosing(self._source(target, route, leg)) as messages:
                        async for message in messages:
                            answered = True
                            done = progress.saw(message, target)
                            if done:
                                self._complete(call, request, route, message.final, target, attempt)
                            yield message
                            if done:
                                return
                    raise TargetFailed(
                        target, ServeCode.INTERNAL, "stream ended without a final message", retryable=True
                    )
                except TargetFailed as e:
                    self._log.warning(
                        f"failed:{target}:{e.code.name}", "request %s: %s failed (%s): %s", leg.request_id, target,
                        e.code.name, e.message,
                    )
                    if not answered:
                        self.router.refused(target)
                    continued = progress.check_retryable(e)
                    if continued is not None:
                        failed.add(target)
                        call.migrations[request.index] = progress.migrations
                        self.router.counters.migrations += 1
                        log.info(
                            "request %s: %s failed after streaming %d tokens; continuing it as %s elsewhere",
                            request.request_id, target, progress.tokens, continued.request_id,
                        )
                        break
                    failures.append(e)
                finally:
                    self.router.end(target, ticket)
            if continued is None:
                raise progress.exhausted(failures)
            leg = continued

    def _trusted_first(self, ranked: tuple[str, ...]) -> list[str]:
        """The policy's ranking with peers gossip does not fully trust (suspect, never seen alive) moved last: a
        frozen or made-up peer is tried only when nothing else is left."""
        trusted = self.peer_trusted
        if trusted is None:
            return list(ranked)
        good = [t for t in ranked if t == self.node_id or trusted(t)]
        return good + [t for t in ranked if t not in good] if len(good) < len(ranked) else list(ranked)

    def _complete(
        self, call: Call, request: Request, route: Route, final: node_pb2.GenerateFinal, target: str, attempt: int
    ) -> None:
        """Fill the ingress's part of a sequence's final message and account for it."""
        served_by = final.served_by or target
        now = time.monotonic()
        final.ingress = self.node_id
        final.policy = route.decision.policy
        final.estimated_match_tokens = route.estimated_tokens(served_by)
        final.attempts = attempt
        final.plan_epoch = route.plan_epoch
        final.plan_planner = route.plan_planner
        final.plan_destinations[:] = route.plan_destinations
        final.timings.total_s = now - call.arrived
        self.router.record_outcome(route, served_by, final.cached_tokens)
        if final.migrations:
            _within_prompt(final)
        decided = route.decision.pull
        if final.HasField("pull") and decided is not None and final.pull.holder == decided.holder:
            # the prefix pull this ingress decided (segment pulls teach the node that made them); a report naming
            # another holder is the serving peer's word alone: each made-up name would have been one more figure
            p = final.pull
            self.router.record_pull(p.holder, p.bytes, p.seconds, p.outcome == "ok")
        call.finals[request.index] = final
        if self.on_served is not None:
            self.on_served(route, final)
        if self.observer is not None:
            ttft = call.first_token_at.get(request.index, now) - call.arrived
            self.observer(call.api, "local" if served_by == self.node_id else "forwarded", ttft, now - call.arrived)

    async def _merged(self, call: Call) -> AsyncIterator[node_pb2.GenerateResponse]:
        """The call's sequences run concurrently, interleaved into one stream; the first failure ends them all."""
        queue: asyncio.Queue[node_pb2.GenerateResponse | _Ended] = asyncio.Queue(MERGE_BUFFER_MESSAGES)

        async def pump(request: Request) -> None:
            error: ServeError | None = None
            try:
                async with contextlib.aclosing(self._sequence(call, request)) as messages:
                    async for message in messages:
                        await queue.put(message)
            except ServeError as e:
                error = e
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if task is None or task.cancelling():
                    raise  # the call is over (its client went away, or another sequence failed)
                # Cancelled from below, nobody cancelling this sequence: a failure like any other, never a hang
                log.warning("request %s: a step was cancelled under it", request.request_id)
                error = ServeError(ServeCode.UNAVAILABLE, "the request was cancelled inside this node; retry it")
            except Exception as e:  # a bug must end the call, not leave its client waiting
                log.exception("request %s failed", request.request_id)
                error = ServeError(ServeCode.INTERNAL, f"internal error: {type(e).__name__}")
            await queue.put(_Ended(error))

        tasks = [asyncio.create_task(pump(s), name=f"seq-{s.request_id}") for s in call.sequences]
        try:
            running = len(tasks)
            while running:
                item = await queue.get()
                if isinstance(item, _Ended):
                    running -= 1
                    if item.error is not None:
                        raise item.error
                    continue
                yield item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    # --- accounting -------------------------------------------------------------------------------------------

    def _finish(self, call: Call, outcome: str, code: ServeCode, error: str = "") -> None:
        """Count the call and write its access line; a sequence cut short (client gone, failure after output) is
        accounted with what it did: the node that streamed it, its prompt, the tokens it streamed, its attempts."""
        self.counters.count(call.api, outcome)
        finals = [call.finals[i] for i in sorted(call.finals)]
        cut = [s for s in call.sequences if s.index not in call.finals and s.index in call.serving]
        served_by = [f.served_by for f in finals] + [call.serving[s.index] for s in cut]
        fields: dict[str, object] = {
            "ingress": self.node_id,
            "served_by": ",".join(dict.fromkeys(served_by)) or "-",
            "policy": call.policy or "-",
            "sequences": len(call.sequences),
            "prompt_tokens": sum(f.prompt_tokens for f in finals) + sum(len(s.tokens) for s in cut),
            "completion_tokens": sum(f.completion_tokens for f in finals)
            + sum(call.streamed_tokens.get(s.index, 0) for s in cut),
            "cached_tokens": sum(f.cached_tokens for f in finals),
            "estimated_tokens": sum(f.estimated_match_tokens for f in finals),
            "attempts": max([f.attempts for f in finals] + list(call.attempts.values()), default=0),
            "migrations": sum(f.migrations for f in finals) + sum(call.migrations.get(s.index, 0) for s in cut) or None,
            "ttft_ms": (
                round((min(call.first_token_at.values()) - call.arrived) * 1e3, 2) if call.first_token_at else None
            ),
            "total_ms": round((time.monotonic() - call.arrived) * 1e3, 2),
        }
        if error:
            fields["error"] = error
        self._access(call.api, call.call_id, code, fields)

    def _access(
        self, api: str, call_id: str, code: ServeCode, fields: dict[str, object], sample: str | None = None
    ) -> None:
        """One INFO line per client call: ``request <id> api=... status=... key=value...`` (JSON: the same keys);
        ``sample``: the kind of a refusal, whose lines are rate-limited (``reject``)."""
        if not access_log.isEnabledFor(logging.INFO):
            return
        # A refused call's id is the client's, unchecked: never let it forge lines or flood one (fuzzed by the faults)
        if len(call_id) > MAX_REQUEST_ID_CHARS or not call_id.isprintable():
            call_id = ascii(call_id[:MAX_REQUEST_ID_CHARS])
        record = {"request_id": call_id, "api": api, "status": code.name, **fields}
        text = " ".join(f"{k}={v}" for k, v in record.items() if k not in ("request_id", "error") and v is not None)
        if "error" in record:
            text += f" error={record['error']!r}"
        if sample is not None:
            self._rejections.info(sample, "request %s %s", call_id, text, extra={"access": record})
        else:
            access_log.info("request %s %s", call_id, text, extra={"access": record})


@dataclass(frozen=True, slots=True)
class _Ended:
    """A sibling sequence ended (``error`` None: it delivered its final message)."""

    error: ServeError | None


class _Progress:
    """What one sequence has streamed to its client so far, across its attempts and migrations: once anything has,
    a failure either continues it on another node from exactly there (``migration.py``) or ends the sequence
    (retrying it from the start would duplicate the output)."""

    __slots__ = ("call", "decode", "index", "kept", "leg_messages", "limit", "migrations", "request", "seam",
                 "sent_text", "token_ids", "tokens", "tokens_before_leg")

    def __init__(self, call: Call, request: Request, decode: Decode, migration_limit: int) -> None:
        self.call, self.request, self.index, self.decode = call, request, request.index, decode
        self.limit = migration_limit
        #: Whether the output is kept for a continuation (whether one would reproduce it is judged on failure).
        self.kept = migration_limit > 0
        #: Messages from the node serving the current leg (the sequence itself, or its latest continuation).
        self.leg_messages = 0
        self.tokens = 0
        #: The output token ids and text sent to the client (kept only while the sequence could still migrate).
        self.token_ids: list[int] = []
        self.sent_text: list[str] = []
        self.migrations = 0
        self.tokens_before_leg = 0
        self.seam: TextSeam | StopSeam | None = None

    def saw(self, message: node_pb2.GenerateResponse, target: str) -> bool:
        """Account for a message from ``target`` on its way to the client (a continuation's made to read as the
        sequence's own); whether it is the final one."""
        call, index = self.call, self.index
        message.index = index
        final = message.HasField("final")
        if isinstance(self.seam, StopSeam):
            final = self._stop_at_seam(self.seam, message, target, final)
        elif self.seam is not None:
            hidden = _ended_by_stop_token(message, final) and not self.request.sampling.include_stop_str_in_output
            message.text = self.seam.text(message.token_ids, message.text, stop_token=hidden)
        if index not in call.first_token_at and (message.token_ids or message.text):
            call.first_token_at[index] = time.monotonic()
        self.leg_messages += 1
        self.tokens += len(message.token_ids)
        if self.kept:
            self.token_ids.extend(message.token_ids)
            self.sent_text.append(message.text)
        call.serving[index] = target
        call.streamed_tokens[index] = self.tokens
        if final and self.migrations:
            f = message.final
            f.request_id = self.request.request_id
            f.prompt_tokens = len(self.request.tokens)
            f.completion_tokens += self.tokens_before_leg
            f.migrations = self.migrations
        return final

    def _stop_at_seam(self, seam: StopSeam, message: node_pb2.GenerateResponse, target: str, final: bool) -> bool:
        """Check a continuation message for stop strings across the seam (``StopSeam``); when one ends the sequence
        there, cut the message after the token completing it and make it the final one (its node's engine request
        is aborted as the stream closes). Whether the message is final."""
        f = message.final
        cut = seam.take(message.token_ids, message.text, last=final, by_token=_ended_by_stop_token(message, final))
        message.text = cut.text
        if not cut.stop or cut.keep is None:
            return final
        dropped = len(message.token_ids) - cut.keep
        del message.token_ids[cut.keep:]
        del message.logprobs[cut.keep:]
        if final:
            f.completion_tokens -= dropped
        else:
            f.served_by = target
            f.completion_tokens = self.tokens - self.tokens_before_leg + cut.keep
        f.finish_reason = node_pb2.FINISH_REASON_STOP
        f.stop_reason = cut.stop
        return True

    def check_retryable(self, failure: TargetFailed) -> Request | None:
        """After ``failure``: None when another node may serve the sequence from the start, the continuation to
        route when one may continue it; raise the ServeError that ends the sequence otherwise."""
        if not self.leg_messages:
            if not failure.retryable:  # after a migration, output was sent: never a status that says "retry it"
                raise (self.exhausted([failure]) if self.migrations else failure.serve_error()) from failure
            return None
        request, sent_text = self.request, "".join(self.sent_text)
        why = self._unmigratable(failure)
        seam: TextSeam | StopSeam | None = None
        if not why and request.sampling.stop:
            s = request.sampling
            seam = StopSeam.build(self.decode, request.tokens, self.token_ids, sent_text, s.stop,
                                  s.include_stop_str_in_output)
            if seam is None:
                why = ("its stop strings cannot be checked across the seam: it falls inside a character, or the "
                       "engine's decode is not what it streamed")
        if why:
            raise ServeError(
                ServeCode.UNAVAILABLE,
                f"node {failure.node_id} failed after streaming {self.tokens} tokens ({failure.code.name}: "
                f"{failure.message}); the partial output ({self.tokens} tokens) is all this call returns: retrying "
                f"elsewhere would duplicate it, and it cannot be continued elsewhere ({why})",
            ) from failure
        self.seam = seam or TextSeam(self.decode, request.tokens, self.token_ids, sent_text)
        self.migrations += 1
        self.tokens_before_leg, self.leg_messages = self.tokens, 0
        return continuation(request, self.token_ids, self.migrations)

    def _unmigratable(self, failure: TargetFailed) -> str:
        """Why the sequence cannot be continued elsewhere after ``failure`` ("": it can)."""
        if not failure.retryable:
            return f"a {failure.code.name} failure would end it anywhere"
        if not self.limit:
            return "migration is off: --migration-limit 0"
        if self.migrations >= self.limit:
            return f"it was continued {self.migrations} time(s) already: --migration-limit {self.limit}"
        if self.tokens >= self.request.max_tokens:
            return "every token it asked for was sent"
        return not_resumable(self.request, self.tokens)

    def exhausted(self, failures: list[TargetFailed]) -> ServeError:
        """Why no candidate served the sequence (or, after a migration, continued it)."""
        error = _exhausted(failures)
        if not self.migrations:
            return error
        return ServeError(  # UNAVAILABLE, as any failure after output: an overload's status would ask for a retry
            ServeCode.UNAVAILABLE,
            f"the sequence failed after streaming {self.tokens} tokens and no other node could continue it "
            f"({error.message}); the partial output ({self.tokens} tokens) is all this call returns",
        )


def _ended_by_stop_token(message: node_pb2.GenerateResponse, final: bool) -> bool:
    """Whether ``message`` is the last and a stop token ended the sequence (STOP with no stop string)."""
    f = message.final
    return final and f.finish_reason == node_pb2.FINISH_REASON_STOP and not f.stop_reason


def _within_prompt(final: node_pb2.GenerateFinal) -> None:
    """A continued sequence's final as the client's request reads: its continuation's prompt was the prompt and the
    tokens streamed before, so what it found cached (and routing expected, and where from) may exceed the prompt it
    reports; each is kept within it (vLLM's usage never reports more cached tokens than prompt tokens)."""
    prompt = final.prompt_tokens
    final.cached_tokens = min(final.cached_tokens, prompt)
    final.index_match_tokens = min(final.index_match_tokens, prompt)
    final.estimated_match_tokens = min(final.estimated_match_tokens, prompt)
    left, hits = final.cached_tokens, final.tier_hits
    for name in ("gpu", "host", "disk", "pulled"):
        kept = min(getattr(hits, name), left)
        setattr(hits, name, kept)
        left -= kept


def _exhausted(failures: list[TargetFailed]) -> ServeError:
    """Why no candidate served a sequence: every one full (overload), or each failed its own way."""
    summary = "; ".join(f"{f.node_id}: {f.code.name} {f.message}" for f in failures)
    if failures and all(f.code == ServeCode.RESOURCE_EXHAUSTED for f in failures):
        retry_after = min((f.retry_after_s for f in failures if f.retry_after_s is not None), default=1.0)
        return ServeError(
            ServeCode.RESOURCE_EXHAUSTED, f"mesh overloaded: every candidate is full ({summary})",
            throttle=Throttle.OVERLOAD, retry_after_s=retry_after,
        )
    return ServeError(ServeCode.UNAVAILABLE, f"no node could serve the request ({summary})")
