"""Record what a stock ``vllm serve`` answers to every endpoint and parameter of the OpenAI surface p2pnode serves, as
the fixture tests/integration/test_vllm_surface.py compares a two-node p2pnode mesh with.

    # a stock server of the tiny model, with the engine settings of the integration mesh (block 32, 4k context):
    VLLM_CPU_KVCACHE_SPACE=1 python scripts/vllm_cli.py serve models/tiny --enforce-eager --block-size 32 \\
        --max-model-len 4096 --served-model-name tiny --host 127.0.0.1 --port 18000
    python scripts/record_vllm_surface.py --base-url http://127.0.0.1:18000        # rewrites the fixture
    python scripts/record_vllm_surface.py --base-url http://127.0.0.1:51051 --api-key K --compare   # a p2pnode node

Each case is sent as plain HTTP (what every client library sends) and recorded as its status code, the shape of its
JSON answer (every field's name and JSON type, lists by the shapes of their items), for a stream the SSE events' names
and their data's shapes, and the values of the fields named in ``same`` (greedy text, finish reasons, token counts:
the same model with the same settings answers them identically). ``--compare`` prints the differences instead of
writing (the test does the same through ``compare``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests" / "integration" / "fixtures" / "vllm_serve_answers.json"
MODEL = "tiny"
#: Fields p2pnode adds to vLLM's answers (docs/api.md), which clients keep or ignore: the mesh's own (which node
#: served, what it had cached), and the cached prompt tokens in usage (OpenAI's prompt_tokens_details, Anthropic's
#: cache_read_input_tokens), which vLLM reports only with --enable-prompt-tokens-details.
P2PNODE_EXTRA_FIELDS = frozenset({"p2pnode", "prompt_tokens_details", "cache_read_input_tokens"})
#: Fields vLLM has that p2pnode leaves out, and why: ``system_fingerprint`` hashes one engine's configuration, and a
#: mesh call's answer may come from any node's engine.
KNOWN_MISSING_FIELDS = frozenset({"system_fingerprint"})

_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Name three colours."}]}
_GREEDY = {"temperature": 0, "max_tokens": 6, "ignore_eos": True}
#: The chat prompt's greedy text, compared, stops at 4 tokens: its 6th is an exact tie in bf16 (`e` and U+0332 both
#: at logprob -5.3772), which the host that first recorded it broke one way and an AVX2-only AMD EPYC the other.
#: ``prompt_logprobs``'s prompt ties at its 5th token (both known hosts break it alike): 4 tokens there too.
_SHORT_GREEDY = {**_GREEDY, "max_tokens": 4}
_USAGE = ("usage.prompt_tokens", "usage.completion_tokens", "usage.total_tokens")
_SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}

#: (name, method, path, JSON body or None, fields whose values must be the same, dotted; list items by index)
CASES: list[tuple[str, str, str, dict[str, Any] | None, tuple[str, ...]]] = [
    ("version", "GET", "/version", None, ()),
    ("ping_get", "GET", "/ping", None, ()),
    ("ping_post", "POST", "/ping", None, ()),
    ("load", "GET", "/load", None, ()),
    ("models", "GET", "/v1/models", None, ("data.0.id",)),
    ("completion", "POST", "/v1/completions", {"model": MODEL, "prompt": "the quick brown fox", **_GREEDY},
     ("choices.0.text", "choices.0.finish_reason", *_USAGE)),
    ("completion_stream", "POST", "/v1/completions",
     {"model": MODEL, "prompt": "the quick brown fox", "stream": True, **_GREEDY}, ()),
    ("chat", "POST", "/v1/chat/completions", {**_CHAT, **_SHORT_GREEDY},
     ("choices.0.message.content", "choices.0.finish_reason", *_USAGE)),
    ("chat_stream", "POST", "/v1/chat/completions",
     {**_CHAT, "stream": True, "stream_options": {"include_usage": True}, **_GREEDY}, ()),
    ("min_p", "POST", "/v1/completions", {"model": MODEL, "prompt": "abc", "min_p": 0.5, **_GREEDY},
     ("choices.0.text", *_USAGE)),
    ("stop_token_ids", "POST", "/v1/completions",
     {"model": MODEL, "prompt": "abc", "stop_token_ids": [2], **_GREEDY}, ("usage.prompt_tokens",)),
    ("include_stop_str_in_output", "POST", "/v1/completions",
     {"model": MODEL, "prompt": "abc", "stop": ["e"], "include_stop_str_in_output": True, "temperature": 0,
      "max_tokens": 6}, ("choices.0.text", "choices.0.finish_reason")),
    ("logit_bias", "POST", "/v1/completions",
     {"model": MODEL, "prompt": "abc", "logit_bias": {"50": 100}, **_GREEDY}, ("choices.0.text",)),
    ("priority", "POST", "/v1/completions", {"model": MODEL, "prompt": "abc", "priority": 0, **_GREEDY},
     ("choices.0.text",)),
    ("echo", "POST", "/v1/completions",
     {"model": MODEL, "prompt": "abc", "echo": True, "logprobs": 1, **_GREEDY}, ("choices.0.text",)),
    ("prompt_logprobs", "POST", "/v1/completions",
     {"model": MODEL, "prompt": "abc def", "prompt_logprobs": 1, **_SHORT_GREEDY}, ("choices.0.text",)),
    ("logprobs_chat", "POST", "/v1/chat/completions", {**_CHAT, "logprobs": True, "top_logprobs": 2, **_SHORT_GREEDY},
     ("choices.0.message.content",)),
    ("response_format_json_object", "POST", "/v1/chat/completions",
     {**_CHAT, "response_format": {"type": "json_object"}, "temperature": 0, "max_tokens": 8}, ()),
    ("response_format_json_schema", "POST", "/v1/chat/completions",
     {**_CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": _SCHEMA}},
      "temperature": 0, "max_tokens": 8}, ()),
    ("structured_outputs_choice", "POST", "/v1/completions",
     {"model": MODEL, "prompt": "pick", "structured_outputs": {"choice": ["yes", "no"]}, "temperature": 0,
      "max_tokens": 4}, ("choices.0.text",)),
    ("unknown_field_ignored", "POST", "/v1/completions",
     {"model": MODEL, "prompt": "abc", "not_a_vllm_field": 1, **_GREEDY}, ("choices.0.text",)),
    ("chat_template_refused", "POST", "/v1/chat/completions",
     {**_CHAT, "chat_template": "{{ messages }}", "max_tokens": 1}, ("error.type", "error.code")),
    ("stop_five_refused", "POST", "/v1/completions",
     {"model": MODEL, "prompt": "abc", "stop": ["a", "b", "c", "d", "e"], "max_tokens": 1}, ("error.code",)),
    ("unknown_model", "POST", "/v1/completions", {"model": "nope", "prompt": "abc", "max_tokens": 1},
     ("error.type", "error.code")),
    ("top_p_out_of_range", "POST", "/v1/completions", {"model": MODEL, "prompt": "abc", "top_p": 7},
     ("error.type", "error.code")),
    ("messages", "POST", "/v1/messages",
     {"model": MODEL, "max_tokens": 6, "system": "be brief", "temperature": 0,
      "messages": [{"role": "user", "content": "hello"}]},
     ("type", "role", "stop_reason", "content.0.text", "usage.output_tokens")),
    ("messages_stream", "POST", "/v1/messages",
     {"model": MODEL, "max_tokens": 4, "temperature": 0, "stream": True,
      "messages": [{"role": "user", "content": "hi"}]}, ()),
    ("responses", "POST", "/v1/responses",
     {"model": MODEL, "input": "hello", "instructions": "be brief", "max_output_tokens": 6, "temperature": 0},
     ("object", "status", "usage.output_tokens")),
    ("responses_stream", "POST", "/v1/responses",
     {"model": MODEL, "input": "hi", "max_output_tokens": 4, "temperature": 0, "stream": True}, ()),
    ("responses_previous_id", "POST", "/v1/responses",
     {"model": MODEL, "input": "again", "previous_response_id": "resp_0123456789abcdef", "max_output_tokens": 2},
     ("error.code",)),
]


def shape(value: Any) -> Any:
    """A JSON value's shape: objects by their fields' shapes, lists by their items' (merged), scalars by type."""
    if isinstance(value, dict):
        return {k: shape(v) for k, v in sorted(value.items())}
    if isinstance(value, list):
        merged: Any = None
        for item in value:
            merged = _merge(merged, shape(item))
        return [merged] if value else []
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "null"


def _merge(a: Any, b: Any) -> Any:
    """Two shapes as one: fields of either, a null giving way to a value, differing types as "mixed"."""
    if a is None or b is None:
        return b if a is None else a
    if isinstance(a, dict) and isinstance(b, dict):
        return {k: _merge(a.get(k), b.get(k)) for k in sorted({*a, *b})}
    if isinstance(a, list) and isinstance(b, list):
        items = [x[0] for x in (a, b) if x]
        return [_merge(items[0], items[-1]) if len(items) == 2 else items[0]] if items else []
    if a == b or b == "null":
        return a
    return b if a == "null" else "mixed"


def _pick(value: Any, path: str) -> Any:
    for part in path.split("."):
        if isinstance(value, list):
            value = value[int(part)] if int(part) < len(value) else None
        elif isinstance(value, dict):
            value = value.get(part)
        else:
            return None
    return value


def _events(text: str) -> tuple[list[str], Any]:
    """An SSE body's event names in order (consecutive repeats once; "data" for unnamed events, "[DONE]" for the
    end) and the merged shape of its data objects."""
    names: list[str] = []
    merged: Any = None
    event = "data"
    for line in text.splitlines():
        if line.startswith("event:"):
            event = line[6:].strip()
        elif line.startswith("data:"):
            data = line[5:].strip()
            name = "[DONE]" if data == "[DONE]" else event
            if not names or names[-1] != name:
                names.append(name)
            if data != "[DONE]":
                merged = _merge(merged, shape(json.loads(data)))
            event = "data"
    return names, merged


def answer(client: httpx.Client, method: str, path: str, body: dict[str, Any] | None,
           same: tuple[str, ...]) -> dict[str, Any]:
    """One case's answer as recorded: status, and the shape (or the events) and the ``same`` values."""
    return answer_of(client.request(method, path, json=body), same)


def answer_of(reply: httpx.Response, same: tuple[str, ...]) -> dict[str, Any]:
    """What ``answer`` records of a reply, however it was sent (plain HTTP here; the tests also send through the
    ``openai`` and ``anthropic`` clients)."""
    out: dict[str, Any] = {"status": reply.status_code}
    if reply.headers.get("content-type", "").startswith("text/event-stream"):
        out["events"], out["shape"] = _events(reply.text)
        return out
    try:
        data = reply.json()
    except ValueError:
        out["text"] = reply.text
        return out
    out["shape"] = shape(data)
    out["same"] = {path_: _pick(data, path_) for path_ in same}
    return out


def record(base_url: str, api_key: str | None = None) -> dict[str, dict[str, Any]]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with httpx.Client(base_url=base_url, headers=headers, timeout=120) as client:
        return {name: {"method": method, "path": path, "body": body, "same": list(same),
                       "answer": answer(client, method, path, body, same)}
                for name, method, path, body, same in CASES}


def _shape_differences(stock: Any, ours: Any, where: str) -> list[str]:
    if isinstance(stock, dict):
        if not isinstance(ours, dict):
            return [f"{where}: stock has an object, p2pnode {ours!r}"]
        out = [f"{where}.{k}: missing" for k in stock if k not in ours and k not in KNOWN_MISSING_FIELDS]
        out += [f"{where}.{k}: extra" for k in ours if k not in stock and k not in P2PNODE_EXTRA_FIELDS]
        for k in stock:
            if k in ours:
                out += _shape_differences(stock[k], ours[k], f"{where}.{k}")
        return out
    if isinstance(stock, list):
        if not isinstance(ours, list):
            return [f"{where}: stock has a list, p2pnode {ours!r}"]
        if stock and ours:
            return _shape_differences(stock[0], ours[0], f"{where}[]")
        return []
    if stock == "null" or ours == "null":  # null where the other has a value: optional fields
        return []
    return [] if stock == ours else [f"{where}: stock {stock}, p2pnode {ours}"]


def compare(stock: dict[str, Any], ours: dict[str, Any]) -> list[str]:
    """How p2pnode's answer to a case differs from stock vLLM's (empty: the same)."""
    out = []
    if stock["status"] != ours["status"]:
        out.append(f"status: stock {stock['status']}, p2pnode {ours['status']}")
    if "events" in stock and stock["events"] != ours.get("events"):
        out.append(f"events: stock {stock['events']}, p2pnode {ours.get('events')}")
    out += _shape_differences(stock.get("shape"), ours.get("shape"), "")
    for path, value in stock.get("same", {}).items():
        if ours.get("same", {}).get(path) != value:
            out.append(f"{path}: stock {value!r}, p2pnode {ours.get('same', {}).get(path)!r}")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", required=True, help="the server, e.g. http://127.0.0.1:18000")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--compare", action="store_true", help="compare with the fixture instead of writing it")
    parser.add_argument("--fixture", type=Path, default=FIXTURE)
    args = parser.parse_args()
    answers = record(args.base_url, args.api_key)
    if not args.compare:
        args.fixture.parent.mkdir(parents=True, exist_ok=True)
        args.fixture.write_text(json.dumps(answers, indent=1, sort_keys=True) + "\n")
        print(f"recorded {len(answers)} cases in {args.fixture}")
        return 0
    stock = json.loads(args.fixture.read_text())
    failed = 0
    for name, case in stock.items():
        diffs = compare(case["answer"], answers[name]["answer"])
        failed += bool(diffs)
        print(f"{name:<30} {'same' if not diffs else '; '.join(diffs)}")
    print(f"{len(stock) - failed} of {len(stock)} cases answered as stock vLLM")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
