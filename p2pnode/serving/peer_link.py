"""A stream per peer: the requests an ingress forwards to one peer, multiplexed on one long-lived call (``Link``).

Why: a gRPC call costs each side a few hundred microseconds of CPU on a small host, more than the frames of a stream
already open (docs/results.md, "The OpenAI-compatible front and forwarding"). An ingress keeps one link to each peer it
forwards to (``PeerChannels.link``) and sends each request on it under an id; everything a call of its own gave the
request is kept per request:

- **Authentication**: a request is opened with the very envelope a Forward call carries, and the server opens and
  checks it the same way (``ForwarderService.served``); with mTLS the link's caller is bound once for all of them.
- **Deadlines**: the open carries the request's remaining time; the server ends the request DEADLINE_EXCEEDED when it
  passes, and the ingress fails it at its own deadline and cancels it there.
- **Cancellation, both ways**: an ingress giving a request up (its client left, a first-token timeout, gossip saw the
  peer fail) sends a cancel, which aborts the engine request there; the server ends a request with the status a call
  would end with, a throttled refusal's retry-after included.
- **Flow control per request**: the server sends a request at most the credit the ingress gave it (``window``
  messages at the open, more as the ingress relays them), so a slow client holds back its own request only -- the
  link and the other requests on it flow -- and what a request buffers at the ingress is bounded by its window.
- **Failure**: a link that breaks (the peer gone, a keepalive ping unanswered, the peer stopping) ends every request
  on it UNAVAILABLE, as their calls would have ended; the next request opens a new link.
- **Compatibility**: a peer that does not serve ``Link`` (UNIMPLEMENTED before its hello) gets a call per request,
  the requests already on the link included (``LinkedCall`` falls back by itself), for ``NO_LINK_RETRY_S``.

Invariants: a request's events reach its ``LinkedCall`` in the order the server produced them, the end last (one
writer per side, batches written in order; only that writer task writes, because grpc.aio cancels the whole call
when a task is cancelled inside a write, and a request's task is cancelled whenever its request is given up -- for
the same reason a request's task waits for the batch holding its message through a shield); an id is opened once per
link (ids only grow, the server refuses a link that reuses one); every request opened on a live link gets an end
(its last message's, a refusal's, or its cancel's: a request given up is forgotten at the ingress, and its task at
the server sends nothing more); a request's ``LinkedCall`` ends exactly once (an end event, its deadline, a cancel,
or the link's failure, whichever comes first), and after that nothing for its id is delivered.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Generic, TypeVar

import grpc
from google.protobuf.message import DecodeError

from p2pnode.config import LINK_BATCH_BYTES, LINK_MAX_PENDING_BYTES
from p2pnode.log_limit import LogLimiter
from p2pnode.serving.errors import ServeError
from p2pnode.serving.retry_after import retry_after_seconds, trailing_metadata
from p2pnode.v1 import forward_pb2, node_pb2

log = logging.getLogger("p2pnode.forwarding")

__all__ = ["LINK_METHOD_NAME", "NO_LINK_RETRY_S", "LinkSession", "LinkedCall", "PeerLink", "ServeForwarded"]

LINK_METHOD_NAME = "Link"
#: How long an ingress sends a call per request to a peer that answered UNIMPLEMENTED to a link before asking again
#: (seconds): a peer upgraded meanwhile gets links again.
NO_LINK_RETRY_S = 300.0

#: ``serve(envelope, arrived, deadline, peer_names, peer)``: a forwarded request's response messages, as
#: ``ForwarderService.served`` streams them, or raise ``ServeError`` (its status).
ServeForwarded = Callable[
    [bytes, float, float | None, frozenset[str] | None, str], AsyncIterator[node_pb2.GenerateResponse]
]

_HELLO = forward_pb2.LinkDown().SerializeToString()
_M = TypeVar("_M", forward_pb2.LinkUp, forward_pb2.LinkDown)


#: gRPC's status codes by their number (a link's end carries the number).
_STATUS_OF_CODE = {status.value[0]: status for status in grpc.StatusCode}


def _error(code: grpc.StatusCode, details: str, retry_after_s: int = 0) -> grpc.aio.AioRpcError:
    """The error a call ending with this status would raise, its retry-after as a call's (``retry_after.py``)."""
    trailing = grpc.aio.Metadata(*trailing_metadata(retry_after_s or None))
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailing, details)


class _Batches(Generic[_M]):
    """What waits for one side's writer, in order: the message being filled and the ones filled before it (each at
    most ``LINK_BATCH_BYTES``, an item larger than that alone), each with a future set once it is written (made for
    whoever asks, ``written``). ``pending_bytes``: the items' sizes, as given, of everything not yet taken."""

    __slots__ = ("_bytes", "_factory", "_full", "_items", "_written", "current", "pending_bytes")

    def __init__(self, factory: Callable[[], _M]) -> None:
        self._factory = factory
        self.current = factory()
        self._bytes = 0
        self._items = 0
        self.pending_bytes = 0
        self._written: asyncio.Future[None] | None = None
        self._full: collections.deque[tuple[_M, asyncio.Future[None] | None, int]] = collections.deque()

    def room(self, size: int) -> _M:
        """The message to add an item of ``size`` bytes to: the current one, or a new one when it would overflow."""
        if self._bytes and self._bytes + size > LINK_BATCH_BYTES:
            self._full.append((self.current, self._written, self._bytes))
            self.current, self._bytes, self._items, self._written = self._factory(), 0, 0, None
        self._bytes += size
        self._items += 1
        self.pending_bytes += size
        return self.current

    def written(self) -> asyncio.Future[None]:
        """Done once the current message (the last item added) is written."""
        if self._written is None:
            self._written = asyncio.get_running_loop().create_future()
        return self._written

    def take(self) -> tuple[_M, asyncio.Future[None] | None] | None:
        """The next message to write, oldest first (None: nothing waits)."""
        if self._full:
            message, written, size = self._full.popleft()
            self.pending_bytes -= size
            return message, written
        if not self._items:
            return None
        batch = (self.current, self._written)
        self.pending_bytes -= self._bytes
        self.current, self._bytes, self._items, self._written = self._factory(), 0, 0, None
        return batch


async def _write_batches(batches: _Batches[Any], write: Callable[[bytes], Awaitable[None]]) -> None:
    """Write what waits, in order, each message's future set once it is written."""
    while (batch := batches.take()) is not None:
        message, written = batch
        await write(message.SerializeToString())
        if written is not None and not written.done():
            written.set_result(None)


# --- the ingress's side -------------------------------------------------------------------------------------------


class LinkedCall:
    """One request on a link, read as a unary-stream call is: iterate its messages, ``cancel`` it, its failure raised
    as the ``grpc.aio.AioRpcError`` its call would raise (``forward.ForwardClient.stream`` reads either)."""

    __slots__ = (
        "_error", "_fallback", "_fallback_call", "_items", "_read", "_timer", "_waiter", "cancelled", "ended",
        "envelope", "finished", "id", "link", "started", "timeout",
    )

    def __init__(self, link: PeerLink, call_id: int, envelope: bytes, timeout: float | None) -> None:
        self.link = link
        self.id = call_id
        #: Kept until the peer's hello, to be sent by a call of its own if the peer serves no links.
        self.envelope: bytes | None = envelope
        self.timeout = timeout
        self.started = time.monotonic()
        self._items: collections.deque[bytes] = collections.deque()
        self._waiter: asyncio.Future[None] | None = None
        self._error: BaseException | None = None
        self._read = 0  # messages relayed since the last credit returned
        self._fallback: AsyncIterator[node_pb2.GenerateResponse] | None = None
        self._fallback_call: grpc.aio.UnaryStreamCall | None = None
        self._timer: asyncio.TimerHandle | None = None
        self.ended = False
        self.cancelled = False
        #: Its final message was read: the peer is done with it (a cancel then needs no frame).
        self.finished = False
        if timeout is not None:
            self._timer = asyncio.get_running_loop().call_later(max(timeout, 0.0), self._expire)

    # what the link delivers
    def _push(self, response: bytes) -> None:
        self._items.append(response)
        self._wake()

    def _end(self, error: BaseException | None) -> None:
        """The request is over (``error`` None: OK); nothing more is delivered."""
        if self.ended:
            return
        self.ended = True
        self.envelope = None
        self._error = error
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _expire(self) -> None:
        self._timer = None
        if not self.ended:
            self.link.forget(self, cancel=True)
            self._end(_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"))

    def _fall_back(self, channel: grpc.aio.Channel, method: str) -> None:
        """The peer serves no links: this request goes by a Forward call of its own (its remaining time kept)."""
        envelope = self.envelope
        assert envelope is not None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        remaining = None if self.timeout is None else max(self.timeout - (time.monotonic() - self.started), 0.0)
        method_call = channel.unary_stream(method, response_deserializer=node_pb2.GenerateResponse.FromString)
        self._fallback_call = call = method_call(envelope, timeout=remaining)
        self._fallback = call.__aiter__()
        self.envelope = None
        self._wake()

    # what the ingress does
    def cancel(self) -> bool:
        """Give the request up: the peer aborts it, and reading raises ``asyncio.CancelledError`` (as a call's
        ``cancel``). False when it had ended already."""
        if self._fallback_call is not None:
            return self._fallback_call.cancel()
        if self.ended:
            return False
        self.cancelled = True
        self._items.clear()  # nothing more reaches the reader, as after a call's cancel
        self.link.forget(self, cancel=not self.finished)
        self._end(None)
        return True

    def __aiter__(self) -> LinkedCall:
        return self

    async def __anext__(self) -> node_pb2.GenerateResponse:
        while True:
            if self._fallback is not None:
                return await self._fallback.__anext__()
            if self.cancelled:
                raise asyncio.CancelledError
            if self._items:
                data = self._items.popleft()
                self._read += 1
                if self._read * 2 >= self.link.window and not self.ended:
                    self.link.credit(self.id, self._read)
                    self._read = 0
                message = node_pb2.GenerateResponse.FromString(data)
                if message.HasField("final"):
                    self.finished = True
                return message
            if self.ended:
                if self._error is not None:
                    raise self._error
                raise StopAsyncIteration
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None


class PeerLink:
    """The ingress's end of one link: opens requests on it, routes the peer's events to them, closes when idle."""

    def __init__(
        self,
        channel: grpc.aio.Channel,
        method: str,
        *,
        fallback_method: str,
        window: int,
        idle_s: float,
        max_requests: int,
        on_close: Callable[[PeerLink, bool], None],
    ) -> None:
        """``on_close(link, served)``: the link is over (``served`` False: the peer serves no links)."""
        self.channel = channel
        self.fallback_method = fallback_method
        self.window = window
        self.idle_s = idle_s
        self.max_requests = max_requests
        self.on_close = on_close
        self.calls: dict[int, LinkedCall] = {}
        #: Takes no more requests (retired, or failed).
        self.closed = False
        #: Failed: nothing more is written or read.
        self.failed = False
        #: Whether the peer's hello came (False: not yet).
        self.served = False
        self._next_id = 0
        self._up: _Batches[forward_pb2.LinkUp] = _Batches(forward_pb2.LinkUp)
        self._wake = asyncio.Event()
        self._idle_timer: asyncio.TimerHandle | None = None
        self._call = channel.stream_stream(method)()
        self._reader = asyncio.ensure_future(self._read_events())
        self._writer = asyncio.ensure_future(self._write_frames())

    @property
    def has_room(self) -> bool:
        """Whether it takes another request: open, below its cap of requests, its writer not behind by more than
        ``LINK_MAX_PENDING_BYTES`` (a stalled link: what it would buffer is bounded, the request goes by a call)."""
        return (
            not self.closed and len(self.calls) < self.max_requests and self._up.pending_bytes < LINK_MAX_PENDING_BYTES
        )

    def open(self, envelope: bytes, timeout: float | None) -> LinkedCall:
        """Send a request on this link (``has_room`` must be True)."""
        self._next_id += 1
        call = LinkedCall(self, self._next_id, envelope, timeout)
        self.calls[call.id] = call
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None
        up = self._up.room(len(envelope))
        up.opens.add(id=call.id, envelope=envelope, timeout_s=timeout or 0.0, credit=self.window)
        self._wake.set()
        return call

    def credit(self, call_id: int, messages: int) -> None:
        self._up.room(0).credits.add(id=call_id, messages=messages)
        self._wake.set()

    def forget(self, call: LinkedCall, cancel: bool) -> None:
        """``call`` is over here; ``cancel``: tell the peer to abort it."""
        if self.calls.pop(call.id, None) is None:
            return
        if cancel and not self.failed:  # a retired link too: the peer must stop serving it
            self._up.room(0).cancels.append(call.id)
            self._wake.set()
        if not self.calls:
            self._now_idle()

    def _now_idle(self) -> None:
        """No request is open: a retired link half-closes; another waits ``idle_s`` for the next request."""
        if self._idle_timer is not None:
            self._idle_timer.cancel()
        if self.closed:
            self._idle_timer = None
            self._wake.set()
        else:
            self._idle_timer = asyncio.get_running_loop().call_later(self.idle_s, self.retire)

    def retire(self) -> None:
        """Take no more requests; close once the open ones end (at once when none is)."""
        if self.closed:
            return
        self.closed = True
        self.on_close(self, True)
        if not self.calls:
            self._wake.set()  # the writer half-closes; the peer then ends the link

    def cancel(self) -> None:
        """Close now: every open request ends UNAVAILABLE."""
        self._fail("link closed by this node")
        self._call.cancel()

    async def _write_frames(self) -> None:
        call = self._call
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                await _write_batches(self._up, call.write)
                if self.closed and not self.calls:
                    await call.done_writing()
                    return
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the call ended under the write (the reader says why), or it must end now: nothing
            log.debug("link write failed: %s", e)  # more is written on it, so its reader fails what it carries
            call.cancel()

    async def _read_events(self) -> None:
        call = self._call
        reason = "closed by the peer"
        try:
            while True:
                data = await call.read()
                if data is grpc.aio.EOF:
                    break
                down = forward_pb2.LinkDown.FromString(data)
                if not self.served:
                    self._said_hello()
                for event in down.events:
                    self._deliver(event)
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.UNIMPLEMENTED and not self.served:
                self._no_link()
                return
            reason = f"{e.code().name}: {e.details()}"
        except DecodeError:
            reason = "the peer sent a message that is not a LinkDown"
            call.cancel()
        except asyncio.CancelledError:
            reason = "link closed by this node"
            raise
        finally:
            self._fail(reason)

    def _said_hello(self) -> None:
        self.served = True
        for call in self.calls.values():
            call.envelope = None

    def _deliver(self, event: forward_pb2.LinkEvent) -> None:
        call = self.calls.get(event.id)
        if call is None:
            return  # given up here: the peer has or will have its cancel
        if event.HasField("response"):
            if len(call._items) >= self.window:  # past the credit it was given: a broken peer
                self._fail(f"the peer sent request {event.id} more than its credit")
                self._call.cancel()
                return
            call._push(event.response)
        if event.end:
            del self.calls[event.id]
            if event.code:
                status = _STATUS_OF_CODE.get(event.code, grpc.StatusCode.UNKNOWN)
                call._end(_error(status, event.details, event.retry_after_s))
            else:
                call._end(None)
            if not self.calls:
                self._now_idle()

    def _no_link(self) -> None:
        """The peer answered UNIMPLEMENTED before its hello: it serves no links; every request on this one goes by a
        call of its own."""
        self.failed = True
        calls, self.calls = self.calls, {}
        self._close(served=False)
        for call in calls.values():
            if call.ended:
                continue
            try:
                call._fall_back(self.channel, self.fallback_method)
            except Exception as e:  # the channel is closing (retired meanwhile): the request fails, retryably
                call._end(_error(grpc.StatusCode.UNAVAILABLE, f"peer link closed (no call to fall back on: {e})"))

    def _fail(self, reason: str) -> None:
        self.failed = True
        calls, self.calls = self.calls, {}
        self._close(served=True)
        if calls:
            log.debug("link failed with %d request(s) open: %s", len(calls), reason)
        for call in calls.values():
            call._end(_error(grpc.StatusCode.UNAVAILABLE, f"peer link closed ({reason})"))

    def _close(self, served: bool) -> None:
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None
        if not self.closed:
            self.closed = True
            self.on_close(self, served)
        elif not served:
            self.on_close(self, served)
        self._writer.cancel()


# --- the serving peer's side --------------------------------------------------------------------------------------


class _Served:
    """A request open on a server's link: its task and its credit."""

    __slots__ = ("credit", "more", "task")

    def __init__(self, credit: int) -> None:
        self.credit = credit
        self.more: asyncio.Event | None = None
        self.task: asyncio.Task[None] | None = None


class LinkSession:
    """The serving peer's end of one link: serves each request opened on it as a Forward call would be served
    (``serve``), and sends their messages and ends back, batched."""

    def __init__(
        self,
        serve: ServeForwarded,
        context: grpc.aio.ServicerContext,
        peer_names: frozenset[str] | None,
        max_requests: int,
        log_limit: LogLimiter,
    ) -> None:
        self.serve = serve
        self.context = context
        self.peer_names = peer_names
        self.peer = context.peer()
        self.max_requests = max_requests
        self._log = log_limit
        self.open: dict[int, _Served] = {}
        self._last_id = 0
        #: A request's task waits for the message holding its response to be written before it reads the next from
        #: the engine, so responses produced meanwhile merge into one, as a call's blocking write makes them. Every
        #: request in the message waits on its one future, each through a shield.
        self._down: _Batches[forward_pb2.LinkDown] = _Batches(forward_pb2.LinkDown)
        self._wake = asyncio.Event()
        self._drained = asyncio.Event()
        self._drained.set()
        self._closing = False
        self._main: asyncio.Task[Any] | None = None
        self._stopped: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def run(self, frames: AsyncIterator[bytes]) -> None:
        """Serve the link until the ingress closes it (its open requests then finish) or it breaks (they are
        aborted)."""
        self._main = asyncio.current_task()
        await self.context.write(_HELLO)
        writer = asyncio.ensure_future(self._write_events())
        reader = asyncio.ensure_future(self._read_frames(frames))
        try:
            await asyncio.wait((reader, self._stopped), return_when=asyncio.FIRST_COMPLETED)
            if not reader.done():
                return  # this node is stopping (``close``): the link ends now, what it carries with it
            problem = reader.result()
            if problem:
                await self._refuse_link(problem)
            drained = asyncio.ensure_future(self._drained.wait())  # the ingress half-closed: its open requests finish
            try:
                await asyncio.wait((drained, self._stopped), return_when=asyncio.FIRST_COMPLETED)
            finally:
                drained.cancel()
            if not self._drained.is_set():
                return  # this node is stopping (``close``) meanwhile
            self._closing = True
            self._wake.set()
            await writer
        finally:
            reader.cancel()
            writer.cancel()
            for served in self.open.values():
                if served.task is not None:
                    served.task.cancel()

    def close(self) -> None:
        """End the link now (a stopping node), without waiting for the ingress to close it."""
        if not self._stopped.done():
            self._stopped.set_result(None)

    async def _read_frames(self, frames: AsyncIterator[bytes]) -> str | None:
        """Act on the ingress's messages until it half-closes; a protocol violation's description (the link is
        then refused)."""
        async for data in frames:
            try:
                up = forward_pb2.LinkUp.FromString(data)
            except DecodeError:
                return "a message that is not a LinkUp"
            problem = self._take(up)
            if problem:
                return problem
        return None

    async def _refuse_link(self, problem: str) -> None:
        self._log.warning("refused:link", "refused a Forward link from %s: %s", self.peer, problem)
        await self.context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"link: {problem}")

    def _take(self, up: forward_pb2.LinkUp) -> str | None:
        """Act on one message of the ingress; a protocol violation's description (the link is then refused)."""
        for i, opened in enumerate(up.opens):
            if opened.id <= self._last_id:
                return f"opens[{i}].id: {opened.id} is not above the last opened ({self._last_id})"
            if opened.credit < 1:
                return f"opens[{i}].credit: must be >= 1"
            if not opened.timeout_s >= 0:
                return f"opens[{i}].timeout_s: must be >= 0"
            self._last_id = opened.id
            if len(self.open) >= self.max_requests:
                message = f"link: {len(self.open)} requests open, the most one link carries"
                self._end(opened.id, grpc.StatusCode.RESOURCE_EXHAUSTED, message)
                continue
            served = _Served(opened.credit)
            self.open[opened.id] = served
            self._drained.clear()
            served.task = asyncio.ensure_future(self._serve_one(opened.id, opened.envelope, opened.timeout_s, served))
            # Forgotten when its task is done, however it ends: a task cancelled before its first step (its cancel in
            # this very message) never runs its body, so a ``finally`` there would never forget it.
            served.task.add_done_callback(functools.partial(self._forget, opened.id))
        for call_id in up.cancels:
            served = self.open.get(call_id)
            if served is not None and served.task is not None:
                served.task.cancel()
        for credit in up.credits:
            served = self.open.get(credit.id)
            if served is not None:
                served.credit += credit.messages
                if served.more is not None:
                    served.more.set()
        return None

    async def _serve_one(self, call_id: int, envelope: bytes, timeout_s: float, served: _Served) -> None:
        arrived = time.monotonic()
        deadline = arrived + timeout_s if timeout_s > 0 else None
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout_at(loop.time() + timeout_s if timeout_s > 0 else None):
                messages = self.serve(envelope, arrived, deadline, self.peer_names, self.peer)
                async with contextlib.aclosing(messages):
                    async for message in messages:
                        while served.credit <= 0:
                            served.more = asyncio.Event()
                            await served.more.wait()
                            served.more = None
                        served.credit -= 1
                        # shielded: the write is the batch's, and cancelling this request must not cancel it for
                        # the others in it (they would end without an end, their ingress waiting on them)
                        await asyncio.shield(self._event(call_id, message.SerializeToString()))
            self._end(call_id, grpc.StatusCode.OK, "")
        except ServeError as e:
            retry_after = 0 if e.retry_after_s is None else retry_after_seconds(e.retry_after_s)
            self._end(call_id, grpc.StatusCode[e.code.name], e.message, retry_after)
        except TimeoutError:
            self._end(call_id, grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
        except asyncio.CancelledError:
            pass  # the ingress cancelled it, or the link is gone: nothing to send
        except Exception as e:  # a bug: the ingress gets INTERNAL (retryable), never a silent loss
            log.exception("serving a request on a link failed")
            message = f"internal error serving a forwarded request: {type(e).__name__}"
            self._end(call_id, grpc.StatusCode.INTERNAL, message)

    def _forget(self, call_id: int, _: object) -> None:
        """A request's task is done: its place on the link is free."""
        self.open.pop(call_id, None)
        if not self.open:
            self._drained.set()

    def _event(self, call_id: int, response: bytes) -> asyncio.Future[None]:
        """Queue a response message; the future is done once it is written."""
        self._down.room(len(response)).events.add(id=call_id, response=response)
        self._wake.set()
        return self._down.written()

    def _end(self, call_id: int, code: grpc.StatusCode, details: str, retry_after_s: int = 0) -> None:
        self._down.room(len(details) + 16).events.add(
            id=call_id, end=True, code=code.value[0], details=details, retry_after_s=retry_after_s
        )
        self._wake.set()

    async def _write_events(self) -> None:
        context = self.context
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                await _write_batches(self._down, context.write)
                if self._closing and not self.open:
                    return
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the link ended under the write (the ingress went away): abort what it carried
            log.debug("link write failed: %s", e)
            if self._main is not None:
                self._main.cancel()
