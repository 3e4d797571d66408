"""Record what a stock ``vllm serve`` answers to every endpoint and parameter of the OpenAI surface p2pnode serves, as
the fixture tests/integration/test_vllm_surface.py compares a two-node p2pnode mesh with.

    # a stock server of the tiny model, with the engine settings of the integration mesh (block 32, 4k context):
    VLLM_CPU_KVCACHE_SPACE=1 python scripts/vllm_cli.py serve models/tiny --enforce-eager --block-size 32 \\
        --max-model-len 4096 --served-model-name tiny --host 127.0.0.1 --port 18000
    python scripts/record_vllm_surface.py --base-url http://127.0.0.1:18000        # rewrites the fixture
    python scripts/record_vllm_surface.py --base-url http://127.0.0.1:18000 --cases a,b   # re-records cases a and b
    python scripts/record_vllm_surface.py --base-url http://127.0.0.1:51051 --api-key K --compare   # a p2pnode node

Each case is sent as plain HTTP (what every client library sends) and recorded as its status code, the shape of its
JSON answer (every field's name and JSON type, lists by the shapes of their items), for a stream the SSE events' names
and their data's shapes, and the values of the fields named in ``same`` (greedy text, finish reasons, token counts:
the same model with the same settings answers them identically). ``--compare`` prints the differences instead of
writing (the test does the same through ``compare``).

Greedy text is the same on every host only as far as each step was decided (tests/greedy.py, which says how the
margin was derived): the tiny model's random weights put its top two tokens within a bf16 rounding of each other
now and then, and hosts with other kernels (AVX2, AVX-512, AMX) break such a near-tie each their own way. So for
every case whose ``same`` values come from a generation, the recorder asks the server for that generation again
with its top log-probabilities (the case itself with logprobs added; /v1/messages, which has none, as the chat vLLM
renders it), checks that this gave the very same text from as many prompt tokens, and records each step's margin:
the chosen token's lead over the next, the logit_bias it was chosen with included. A text is compared up to the
characters its decided steps gave; what the whole generation decides (finish or stop reason, status, token counts)
only if every step was decided, or if max_tokens alone ends it (ignore_eos, nothing to stop at). A case with fewer
than ``MIN_DECIDED_STEPS`` decided steps (all of them, if it generates fewer) is refused: give it another prompt.

Why margins, of the three ways to compare answers that do not hinge on near-ties: a stock engine started beside
the mesh on every run would cost the suite another engine start (~15 s of a core on a 2-core host) and still not
compare p2pnode with the vLLM that users run; a tiny model built so that every step wins by far would have to stay
one whose answers depend on their context (the KV tests rely on loaded KV giving a full prefill's tokens and zeroed
KV other ones), would change every recorded value at once, and is shared by every checkout on a machine. Margins
keep the model and the recording, and say for each step whether it can be compared at all. A recording made on
this host's kernels compared with a stock server on an AVX2-only host's and an AVX-512 host's without bf16 (forced:
tests/greedy.py) differs in nothing it compares.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from tests.greedy import MIN_DECIDED_STEPS, decided_steps, margin  # noqa: E402

FIXTURE = ROOT / "tests" / "integration" / "fixtures" / "vllm_serve_answers.json"
MODEL = "tiny"
#: Fields p2pnode adds to vLLM's answers (docs/api.md), which clients keep or ignore: the mesh's own (which node
#: served, what it had cached), and the cached prompt tokens in usage (OpenAI's prompt_tokens_details, Anthropic's
#: cache_read_input_tokens), which vLLM reports only with --enable-prompt-tokens-details.
P2PNODE_EXTRA_FIELDS = frozenset({"p2pnode", "prompt_tokens_details", "cache_read_input_tokens"})
#: Fields vLLM has that p2pnode leaves out, and why: ``system_fingerprint`` (whole answers, a stream's last chunk)
#: hashes one engine's configuration, and a mesh call's answer may come from any node's engine (as ``vllm serve
#: --fingerprint-mode none`` answers).
KNOWN_MISSING_FIELDS = frozenset({"system_fingerprint"})

#: The ``same`` fields that hold a generation's text: compared as far as its steps were decided.
TEXT_FIELDS = frozenset({"choices.0.text", "choices.0.message.content", "content.0.text", "output.0.content.0.text"})
#: The ``same`` fields (by their last part) that the whole generation decides: compared when every step was decided.
ENDING_FIELDS = frozenset(
    {"finish_reason", "stop_reason", "status", "completion_tokens", "output_tokens", "total_tokens"}
)
#: Top log-probabilities asked for each step of a case's generation (vLLM's default max_logprobs).
PROBE_TOP = 20

_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Name three colours."}]}
_GREEDY = {"temperature": 0, "max_tokens": 6, "ignore_eos": True}
#: A prompt whose six greedy steps the tiny model decides (the recorder refuses a case with too few): "abc" decides
#: only its first two (and "the quick brown fox" none: the completion cases send "Sphinx of black quartz"); "abc"
#: stays where a stop string ends the text at its first token, and where the bias decides every step.
_DECIDED = "xyz"
_USAGE = ("usage.prompt_tokens", "usage.completion_tokens", "usage.total_tokens")
_SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}

#: (name, method, path, JSON body or None, fields whose values must be the same, dotted; list items by index)
CASES: list[tuple[str, str, str, dict[str, Any] | None, tuple[str, ...]]] = [
    ("version", "GET", "/version", None, ()),
    ("tokenize", "POST", "/tokenize", {"model": MODEL, "prompt": "hello there"}, ("tokens",)),
    ("tokenize_token_strs", "POST", "/tokenize", {"model": MODEL, "prompt": "hello there", "return_token_strs": True},
     ("tokens", "token_strs")),
    ("detokenize_special_tokens", "POST", "/detokenize", {"model": MODEL, "tokens": [1, 75, 478, 82, 2]},
     ("prompt",)),
    ("ping_get", "GET", "/ping", None, ()),
    ("ping_post", "POST", "/ping", None, ()),
    ("load", "GET", "/load", None, ()),
    ("models", "GET", "/v1/models", None, ("data.0.id",)),
    ("completion", "POST", "/v1/completions", {"model": MODEL, "prompt": "Sphinx of black quartz", **_GREEDY},
     ("choices.0.text", "choices.0.finish_reason", *_USAGE)),
    ("completion_stream", "POST", "/v1/completions",
     {"model": MODEL, "prompt": "Sphinx of black quartz", "stream": True, **_GREEDY}, ()),
    ("chat", "POST", "/v1/chat/completions", {**_CHAT, **_GREEDY},
     ("choices.0.message.content", "choices.0.finish_reason", *_USAGE)),
    ("chat_stream", "POST", "/v1/chat/completions",
     {**_CHAT, "stream": True, "stream_options": {"include_usage": True}, **_GREEDY}, ()),
    ("chat_add_special_tokens", "POST", "/v1/chat/completions", {**_CHAT, "add_special_tokens": True, **_GREEDY},
     ("usage.prompt_tokens",)),  # the template's BOS, then the tokenizer's
    ("chat_stream_continuous_usage", "POST", "/v1/chat/completions",
     {**_CHAT, "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}, **_GREEDY},
     ()),
    ("return_token_ids", "POST", "/v1/completions",
     {"model": MODEL, "prompt": _DECIDED, "echo": True, "return_token_ids": True, **_GREEDY},
     ("choices.0.prompt_token_ids",)),
    ("return_token_ids_chat_stream", "POST", "/v1/chat/completions",
     {**_CHAT, "stream": True, "return_token_ids": True, **_GREEDY}, ()),
    ("min_p", "POST", "/v1/completions", {"model": MODEL, "prompt": _DECIDED, "min_p": 0.5, **_GREEDY},
     ("choices.0.text", *_USAGE)),
    ("stop_token_ids", "POST", "/v1/completions",
     {"model": MODEL, "prompt": "abc", "stop_token_ids": [2], **_GREEDY}, ("usage.prompt_tokens",)),
    ("include_stop_str_in_output", "POST", "/v1/completions",
     {"model": MODEL, "prompt": "abc", "stop": ["e"], "include_stop_str_in_output": True, "temperature": 0,
      "max_tokens": 6}, ("choices.0.text", "choices.0.finish_reason")),
    ("logit_bias", "POST", "/v1/completions",
     {"model": MODEL, "prompt": "abc", "logit_bias": {"50": 100}, **_GREEDY}, ("choices.0.text",)),
    ("priority", "POST", "/v1/completions", {"model": MODEL, "prompt": _DECIDED, "priority": 0, **_GREEDY},
     ("choices.0.text",)),
    ("echo", "POST", "/v1/completions",
     {"model": MODEL, "prompt": _DECIDED, "echo": True, "logprobs": 1, **_GREEDY}, ("choices.0.text",)),
    ("prompt_logprobs", "POST", "/v1/completions",
     {"model": MODEL, "prompt": "abc def", "prompt_logprobs": 1, **_GREEDY}, ("choices.0.text",)),
    ("logprobs_chat", "POST", "/v1/chat/completions", {**_CHAT, "logprobs": True, "top_logprobs": 2, **_GREEDY},
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
     {"model": MODEL, "prompt": _DECIDED, "not_a_vllm_field": 1, **_GREEDY}, ("choices.0.text",)),
    ("chat_template_refused", "POST", "/v1/chat/completions",
     {**_CHAT, "chat_template": "{{ messages }}", "max_tokens": 1}, ("error.type", "error.code")),
    ("stop_five_refused", "POST", "/v1/completions",
     {"model": MODEL, "prompt": "abc", "stop": ["a", "b", "c", "d", "e"], "max_tokens": 1}, ("error.code",)),
    ("unknown_model", "POST", "/v1/completions", {"model": "nope", "prompt": "abc", "max_tokens": 1},
     ("error.type", "error.code")),
    ("top_p_out_of_range", "POST", "/v1/completions", {"model": MODEL, "prompt": "abc", "top_p": 7},
     ("error.type", "error.code")),
    ("messages", "POST", "/v1/messages",  # "hello" decides only its first step after this system prompt
     {"model": MODEL, "max_tokens": 6, "system": "be brief", "temperature": 0,
      "messages": [{"role": "user", "content": "request route peer"}]},
     ("type", "role", "stop_reason", "content.0.text", "usage.output_tokens")),
    ("messages_stream", "POST", "/v1/messages",
     {"model": MODEL, "max_tokens": 4, "temperature": 0, "stream": True,
      "messages": [{"role": "user", "content": "hi"}]}, ()),
    ("responses", "POST", "/v1/responses",
     {"model": MODEL, "input": "hello", "instructions": "be brief", "max_output_tokens": 6, "temperature": 0},
     ("object", "status", "usage.input_tokens", "usage.output_tokens")),  # input: the rendered chat with a 2nd BOS
    ("responses_messages", "POST", "/v1/responses",
     {"model": MODEL, "input": "hello", "max_output_tokens": 2, "temperature": 0, "enable_response_messages": True},
     ("input_messages.0.message", "input_messages.0.tokens", "usage.input_tokens")),
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


def answer_of(reply: httpx.Response, same: tuple[str, ...]) -> dict[str, Any]:
    """What is recorded of a reply to a case, however it was sent (plain HTTP here; the tests also send through the
    ``openai`` and ``anthropic`` clients): status, and the shape (or the events) and the ``same`` values."""
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


def generates(same: tuple[str, ...] | list[str]) -> bool:
    """Whether a case's ``same`` values come from its generation."""
    return any(p in TEXT_FIELDS or p.rsplit(".", 1)[-1] in ENDING_FIELDS for p in same)


def probe(path: str, body: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The request that makes a case's generation again with each step's top log-probabilities: the case itself where
    it can ask for them (by token id, but for /v1/responses), else, for /v1/messages, the chat vLLM renders it as
    (its system prompt first)."""
    by_id = {"return_tokens_as_token_ids": True}
    if path == "/v1/completions":
        return path, {**body, "echo": False, "logprobs": PROBE_TOP, **by_id}
    if path == "/v1/responses":
        return path, {**body, "top_logprobs": PROBE_TOP, "include": ["message.output_text.logprobs"]}
    chat = body
    if path == "/v1/messages":
        system = [{"role": "system", "content": body["system"]}] if "system" in body else []
        chat = {"model": body["model"], "messages": [*system, *body["messages"]], "temperature": body["temperature"],
                "max_tokens": body["max_tokens"]}
    return "/v1/chat/completions", {**chat, "logprobs": True, "top_logprobs": PROBE_TOP, **by_id}


def generated_of(path: str, reply: dict[str, Any]) -> tuple[str, int]:
    """A reply's generated text (after the prompt, where echoed) and its prompt's length in tokens."""
    usage = reply["usage"]
    prompt_tokens = usage.get("prompt_tokens", usage.get("input_tokens"))
    if path == "/v1/completions":
        return reply["choices"][0]["text"], prompt_tokens
    if path == "/v1/chat/completions":
        return reply["choices"][0]["message"]["content"], prompt_tokens
    if path == "/v1/messages":
        return reply["content"][0]["text"], prompt_tokens
    [message] = [item for item in reply["output"] if item["type"] == "message"]
    return message["content"][0]["text"], prompt_tokens


def _token(text: str) -> int:
    return int(text.removeprefix("token_id:"))


def steps_of(path: str, reply: dict[str, Any]) -> list[tuple[int, dict[int, float]]]:
    """A probe's steps: the chosen token and the top log-probabilities, by token id (for /v1/responses, which names
    tokens by their text, by their place in the step's list: two tokens of the same text are still two)."""
    if path == "/v1/responses":
        [message] = [item for item in reply["output"] if item["type"] == "message"]
        steps = []
        for step in message["content"][0]["logprobs"]:
            top = step["top_logprobs"]
            sampled = (step["bytes"], step["logprob"])
            chosen = next(i for i, t in enumerate(top) if (t["bytes"], t["logprob"]) == sampled)
            steps.append((chosen, {i: t["logprob"] for i, t in enumerate(top)}))
        return steps
    choice = reply["choices"][0]
    if path == "/v1/completions":
        lp = choice["logprobs"]
        return [(_token(t), {_token(k): v for k, v in top.items()})
                for t, top in zip(lp["tokens"], lp["top_logprobs"], strict=True)]
    return [(_token(c["token"]), {_token(t["token"]): t["logprob"] for t in c["top_logprobs"]})
            for c in choice["logprobs"]["content"]]


def greedy(
    client: httpx.Client, name: str, path: str, body: dict[str, Any], reply: dict[str, Any], same: tuple[str, ...]
) -> dict[str, Any]:
    """How far the generation of a case that ``generates`` was decided: each step's margin, the decided steps, and for
    a text compared how many characters those gave. Raises ``ValueError`` when the probe generated another text or
    from another prompt, or when too few steps were decided."""
    probe_path, probe_body = probe(path, body)
    probed = client.post(probe_path, json=probe_body)
    probed.raise_for_status()
    generated, prompt_tokens = generated_of(probe_path, probed.json())
    text, case_prompt_tokens = generated_of(path, reply)
    if not text.endswith(generated) or prompt_tokens != case_prompt_tokens:
        raise ValueError(f"{name}: the probe generated {generated!r} after {prompt_tokens} prompt tokens, the case "
                         f"{text!r} after {case_prompt_tokens}")
    steps = steps_of(probe_path, probed.json())
    bias = {int(t): float(b) for t, b in (body.get("logit_bias") or {}).items()}  # the choice saw it, the raw top not
    margins = [margin(top, chosen, bias) for chosen, top in steps]
    decided = decided_steps(margins)
    if decided < min(MIN_DECIDED_STEPS, len(margins)):
        raise ValueError(f"{name}: only {decided} of {len(margins)} greedy steps decided (margins "
                         f"{[round(m, 4) for m in margins]}): change its prompt")
    chars = {}
    for field in (p for p in same if p in TEXT_FIELDS):
        assert path != "/v1/responses", f"{name}: {field} compared, but its tokens are not known by id"
        tokens = [chosen for chosen, _ in steps[:decided]]
        detokenized = client.post("/detokenize", json={"model": MODEL, "tokens": tokens})
        detokenized.raise_for_status()
        # a character the decided tokens only began (its last bytes still to come) is not decided
        decided_text = detokenized.json()["prompt"].rstrip("\ufffd")
        pairs = zip(generated, decided_text, strict=False)
        agree = next((i for i, (a, b) in enumerate(pairs) if a != b), min(len(generated), len(decided_text)))
        chars[field] = len(str(_pick(reply, field))) - len(generated) + agree  # after the prompt, where echoed
    # with ignore_eos and nothing to stop at, max_tokens alone ends the generation: its end is decided from the start
    forced = bool(body.get("ignore_eos")) and not body.get("stop") and not body.get("stop_token_ids")
    return {"margins": [round(m, 6) for m in margins], "steps": len(margins), "decided_steps": decided,
            "decided_chars": chars, "ending_decided": forced or decided == len(margins)}


def record(
    base_url: str, api_key: str | None = None, margins: bool = True, only: frozenset[str] | None = None
) -> dict[str, dict[str, Any]]:
    """Every case's answer (``only``: these cases'); with ``margins``, how far each generation was decided
    (``greedy``: what a recording needs, not what is compared with one)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    answers, refused = {}, []
    with httpx.Client(base_url=base_url, headers=headers, timeout=120) as client:
        for name, method, path, body, same in CASES:
            if only is not None and name not in only:
                continue
            reply = client.request(method, path, json=body)
            answers[name] = {"method": method, "path": path, "body": body, "same": list(same),
                             "answer": answer_of(reply, same)}
            if not margins:
                continue
            try:
                if generates(same):
                    answers[name]["greedy"] = greedy(client, name, path, body or {}, reply.json(), same)
            except ValueError as e:
                refused.append(str(e))
    if refused:
        raise SystemExit("refused to record:\n  " + "\n  ".join(refused))
    return answers


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


def compare(stock: dict[str, Any], ours: dict[str, Any], greedy: dict[str, Any] | None = None) -> list[str]:
    """How p2pnode's answer to a case differs from stock vLLM's (empty: the same). ``greedy``: how far the stock
    generation was decided (``greedy``'s record): its text is compared that far, and what the whole generation
    decides (its end, its length) only if every step was, or if max_tokens alone ends it."""
    out = []
    if stock["status"] != ours["status"]:
        out.append(f"status: stock {stock['status']}, p2pnode {ours['status']}")
    if "events" in stock and stock["events"] != ours.get("events"):
        out.append(f"events: stock {stock['events']}, p2pnode {ours.get('events')}")
    out += _shape_differences(stock.get("shape"), ours.get("shape"), "")
    for path, value in stock.get("same", {}).items():
        got = ours.get("same", {}).get(path)
        if greedy is not None and path in greedy["decided_chars"]:
            n = greedy["decided_chars"][path]
            value, got = value[:n], got[:n] if isinstance(got, str) else got
        elif greedy is not None and path.rsplit(".", 1)[-1] in ENDING_FIELDS and not greedy["ending_decided"]:
            continue
        if got != value:
            out.append(f"{path}: stock {value!r}, p2pnode {got!r}")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", required=True, help="the server, e.g. http://127.0.0.1:18000")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--compare", action="store_true", help="compare with the fixture instead of writing it")
    parser.add_argument("--fixture", type=Path, default=FIXTURE)
    parser.add_argument("--cases", default=None,
                        help="comma-separated case names: record (or compare) only these, keeping the fixture's others")
    args = parser.parse_args()
    only = frozenset(args.cases.split(",")) if args.cases else None
    unknown = sorted((only or frozenset()) - {name for name, *_ in CASES})
    if unknown:
        parser.error(f"no such cases: {', '.join(unknown)}")
    answers = record(args.base_url, args.api_key, margins=not args.compare, only=only)
    if not args.compare:
        if only is not None:  # the other cases as recorded before
            answers = {**json.loads(args.fixture.read_text()), **answers}
        args.fixture.parent.mkdir(parents=True, exist_ok=True)
        args.fixture.write_text(json.dumps(answers, indent=1, sort_keys=True) + "\n")
        print(f"recorded {len(answers)} cases in {args.fixture}")
        return 0
    stock = {name: case for name, case in json.loads(args.fixture.read_text()).items() if name in answers}
    failed = 0
    for name, case in stock.items():
        diffs = compare(case["answer"], answers[name]["answer"], case.get("greedy"))
        failed += bool(diffs)
        print(f"{name:<30} {'same' if not diffs else '; '.join(diffs)}")
    print(f"{len(stock) - failed} of {len(stock)} cases answered as stock vLLM")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
