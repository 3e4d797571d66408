"""A prompt's KV blocks pulled from a holder (``kv/blocks.py``), the parts that run without vLLM: the holder's block
server streaming a lease over real gRPC (loopback) and the puller writing it into its own blocks; a holder that
sends what it was not asked for fails the pull (the request then computes its prefix), never writes a block half."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest
import torch

from p2pnode.kv.blocks import BlockServer, fetch
from p2pnode.v1 import kv_pb2, kv_pb2_grpc

LAYOUT = "test-layout"
LAYERS, BLOCKS, HEADS, BS, HEAD = 2, 4, 1, 4, 8
DTYPE = torch.bfloat16


def kv_layers(fill: float) -> list[Any]:
    return [torch.full((BLOCKS, HEADS, BS, 2 * HEAD), fill, dtype=DTYPE) for _ in range(LAYERS)]


@pytest.fixture
def holder() -> Iterator[BlockServer]:
    layers = kv_layers(0.0)
    for layer_index, layer in enumerate(layers):
        for block in range(BLOCKS):
            layer[block] = 10 * block + layer_index
    server = BlockServer(layers, LAYOUT, "127.0.0.1", None, max_streams=2)
    yield server
    server.stop()


def test_a_leased_run_arrives_whole_in_the_pullers_blocks(holder: BlockServer) -> None:
    holder.grant("lease", "export", [2, 3], ttl_s=10.0)
    mine = kv_layers(7.0)
    got = fetch(mine, f"127.0.0.1:{holder.port}", "lease", LAYOUT, 0, [0, 1], 10.0)
    assert got.error == "" and got.blocks == 2
    for layer_index, layer in enumerate(mine):
        assert (layer[0] == 20 + layer_index).all() and (layer[1] == 30 + layer_index).all()
        assert (layer[2] == 7.0).all()  # not asked for: untouched


class _SendsALayerTwice(kv_pb2_grpc.KvBlocksServicer):
    """A faulty holder: layer 0 of every block twice, layer 1 never."""

    def Pull(self, request: kv_pb2.BlockPullRequest, context: Any) -> Iterator[kv_pb2.BlockData]:
        size = HEADS * BS * 2 * HEAD * 2  # one (block, layer) in bfloat16
        for block in range(request.first_block, request.first_block + request.count):
            yield kv_pb2.BlockData(block=block, layer=0, data=b"\x01" * size)
            yield kv_pb2.BlockData(block=block, layer=0, data=b"\x01" * size)


def test_a_layer_sent_twice_fails_the_pull_instead_of_passing_for_the_missing_one() -> None:
    """Blocks were counted by messages: a layer sent twice made a block count as whole with another layer never
    written -- that layer kept the KV an earlier request had left in the block (a wrong answer, not a miss)."""
    server = grpc.server(futures.ThreadPoolExecutor(2))
    kv_pb2_grpc.add_KvBlocksServicer_to_server(_SendsALayerTwice(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        got = fetch(kv_layers(7.0), f"127.0.0.1:{port}", "lease", LAYOUT, 0, [1, 2], 10.0)
    finally:
        server.stop(None)
    assert got.blocks == 0 and "twice" in got.error


def test_a_pull_whose_request_ended_first_leaves_nothing_behind() -> None:
    """A client gone while its request waits for its KV: vLLM ends the request, then the worker reports the pull's
    outcome a step later. That outcome was kept for a request nobody would finish again: one entry per aborted pull
    for the life of the engine."""
    import threading
    from types import SimpleNamespace

    from p2pnode.kv import params
    from p2pnode.kv.connector import PeerPullConnector, PullOutcomes

    c = object.__new__(PeerPullConnector)  # the scheduler side's state, without vLLM's config
    c.block_size = 16
    c._lock = threading.Lock()
    c._asked, c._tried, c._exports, c._results, c._external = {}, set(), {}, {}, {}
    c._jobs, c._grants, c._lent, c._fetches, c._fetched = [], [], {}, {}, {}
    c._segment_ops, c._store, c._segment_plans, c._segment_pins, c._segment_loaded = [], None, {}, {}, {}
    source = params.PullSource("A", "127.0.0.1:1", "lease", tuple(range(10)), 10)
    request = SimpleNamespace(request_id="r1", kv_transfer_params=params.wrap(source), num_tokens=200,
                              prompt_token_ids=[1] * 200)
    assert c.get_num_new_matched_tokens(request, 0) == (160, True)  # 10 leased blocks of 16 tokens
    c.update_state_after_alloc(request, SimpleNamespace(get_block_ids=lambda: [list(range(13))]), 160)
    assert c.request_finished(request, list(range(13))) == (False, None)  # the client went away
    outcome = PullOutcomes({"r1": ("failed: CANCELLED", 0, 0, 1.0)})
    c.update_connector_output(SimpleNamespace(kv_connector_worker_meta=outcome))
    assert c._results == {} and c._external == {}
