"""scripts/make_tiny_model.py: a loadable, deterministic, idempotent tiny Llama + tokenizer.

Builds twice (seed 0 and seed 1), each in its own subprocess, in parallel, once per module; the seed-0 build is
compared byte for byte with models/tiny, which another process built with the same script and seed (the
``tiny_model`` fixture rebuilds it when the script changed).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "make_tiny_model.py"

# The tests need the engine extra (scripts/bootstrap.sh installs it): fail loudly rather than skip without it.
for _mod in ("torch", "transformers", "tokenizers", "safetensors"):
    if importlib.util.find_spec(_mod) is None:
        raise ImportError(f"{_mod} is not installed: run scripts/bootstrap.sh (it installs the cpu or gpu extra)")


mtm = load_script("make_tiny_model")


def _digests(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir()) if p.is_file()}


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    base = tmp_path_factory.mktemp("tiny")
    specs = {"a": 0, "c": 1}
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    procs = {
        name: subprocess.Popen(
            [sys.executable, str(SCRIPT), str(base / name), "--seed", str(seed)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for name, seed in specs.items()
    }
    outputs = {}
    for name, p in procs.items():
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, f"build {name} failed:\n{out}\n{err}"
        outputs[name] = out
    return {name: base / name for name in specs}, outputs


def test_summary_line(builds):
    dirs, outputs = builds
    line = outputs["a"].strip().splitlines()[-1]
    assert str(dirs["a"]) in line
    assert "params" in line and "vocab 512" in line and " s" in line


def test_files_present(builds):
    dirs, _ = builds
    names = {p.name for p in dirs["a"].iterdir()}
    for required in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        mtm.FINGERPRINT,
    ):
        assert required in names
    # Only the final directory: no temporary or old directories left beside it.
    assert sorted(p.name for p in dirs["a"].parent.iterdir()) == ["a", "c"]


def test_config_loads(builds):
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(str(builds[0]["a"]), local_files_only=True)
    assert cfg.model_type == "llama"
    assert cfg.vocab_size == 512
    assert cfg.hidden_size == 256 and cfg.num_attention_heads == 4 and cfg.num_key_value_heads == 2
    assert cfg.hidden_size // cfg.num_attention_heads == 64
    assert cfg.num_hidden_layers == 2 and cfg.intermediate_size == 512
    assert cfg.max_position_embeddings == 4096
    assert cfg.tie_word_embeddings is False
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (1, 2, 3)


def test_weights(builds):
    from safetensors import safe_open

    with safe_open(str(builds[0]["a"] / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        assert "lm_head.weight" in keys and "model.embed_tokens.weight" in keys
        emb = f.get_tensor("model.embed_tokens.weight")
        assert tuple(emb.shape) == (512, 256)
        assert str(emb.dtype) == "torch.bfloat16"
        assert 0.005 < float(emb.float().std()) < 0.05
        n = sum(f.get_tensor(k).numel() for k in keys)
    assert n == mtm.read_fingerprint(builds[0]["a"])["num_parameters"]


@pytest.mark.parametrize(
    "text",
    [
        "Hello world",
        "The quick brown fox jumps over the lazy dog.",
        "héllo 日本語 🙂\n\ttabs  and   spaces ",
        "def f(x):\n    return x * 2\n",
        "",
    ],
)
def test_tokenizer_round_trip_and_bos(builds, text, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(builds[0]["a"]), local_files_only=True)
    assert len(tok) == 512
    assert (tok.unk_token, tok.bos_token, tok.eos_token, tok.pad_token) == ("<unk>", "<s>", "</s>", "<pad>")
    assert (tok.unk_token_id, tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 1, 2, 3)
    ids = tok(text)["input_ids"]
    # Documented: every encoding starts with exactly one <s>; add_special_tokens=False gives the bare tokens.
    assert ids[0] == tok.bos_token_id
    bare = tok(text, add_special_tokens=False)["input_ids"]
    assert ids == [tok.bos_token_id, *bare]
    assert tok.unk_token_id not in bare  # byte-level: everything encodes
    assert all(0 <= i < 512 for i in ids)
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert tok.decode(bare) == text


def test_chat_template_renders_conversations_sharing_a_prefix(builds, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(builds[0]["a"]), local_files_only=True)
    system = {"role": "system", "content": "You are a terse assistant."}
    one = [system, {"role": "user", "content": "What is a cache?"}]
    two = [system, {"role": "user", "content": "Why gossip?"}]
    text = tok.apply_chat_template(one, tokenize=False, add_generation_prompt=True)
    assert text == "<s><|system|>\nYou are a terse assistant.</s>\n<|user|>\nWhat is a cache?</s>\n<|assistant|>\n"
    ids_one = tok(tok.apply_chat_template(one, tokenize=False), add_special_tokens=False)["input_ids"]
    ids_two = tok(tok.apply_chat_template(two, tokenize=False), add_special_tokens=False)["input_ids"]
    assert ids_one[0] == tok.bos_token_id and ids_one.count(tok.bos_token_id) == 1
    shared = tok(tok.apply_chat_template([system], tokenize=False), add_special_tokens=False)["input_ids"]
    assert ids_one[: len(shared)] == ids_two[: len(shared)] == shared


def test_same_seed_is_byte_identical(builds, tiny_model):
    dirs, _ = builds
    a, b = _digests(dirs["a"]), _digests(tiny_model)
    assert a == b
    assert "model.safetensors" in a


def test_different_seed_differs(builds):
    dirs, _ = builds
    a, c = _digests(dirs["a"]), _digests(dirs["c"])
    assert a.keys() == c.keys()
    assert a["model.safetensors"] != c["model.safetensors"]
    assert a["tokenizer.json"] != c["tokenizer.json"]


def test_second_call_is_noop(builds, capsys):
    d = builds[0]["a"]
    before = {p.name: (p.stat().st_mtime_ns, p.stat().st_ino) for p in d.iterdir()}
    torch_was_loaded = "torch" in sys.modules
    t0 = time.monotonic()
    assert mtm.main([str(d)]) == 0
    assert time.monotonic() - t0 < 5
    assert "up to date" in capsys.readouterr().out
    after = {p.name: (p.stat().st_mtime_ns, p.stat().st_ino) for p in d.iterdir()}
    assert before == after
    if not torch_was_loaded:
        assert "torch" not in sys.modules


def test_noop_cli_does_not_import_torch(builds):
    code = (
        "import runpy, sys\n"
        "script, out = sys.argv[1], sys.argv[2]\n"
        "sys.argv = [script, out]\n"
        "try:\n"
        "    runpy.run_path(script, run_name='__main__')\n"
        "except SystemExit as e:\n"
        "    assert e.code == 0, e.code\n"
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, str(SCRIPT), str(builds[0]["a"])],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    assert "up to date" in r.stdout


def test_tampered_or_different_params_not_up_to_date(builds, tmp_path):
    src = builds[0]["a"]
    params = mtm.parameters(0, 512)
    assert mtm.up_to_date(src, params)
    assert not mtm.up_to_date(src, mtm.parameters(1, 512))
    assert not mtm.up_to_date(src, mtm.parameters(0, 1024))
    copy = tmp_path / "copy"
    shutil.copytree(src, copy)
    assert mtm.up_to_date(copy, params)
    with open(copy / "tokenizer_config.json", "a") as f:
        f.write(" ")
    assert not mtm.up_to_date(copy, params)


def test_refuses_foreign_directory(tmp_path, capsys):
    d = tmp_path / "not_a_model"
    d.mkdir()
    (d / "important.txt").write_text("keep me")
    assert mtm.main([str(d)]) == 2
    assert "--force" in capsys.readouterr().err
    assert (d / "important.txt").read_text() == "keep me"


def test_rejects_too_small_vocab(tmp_path):
    with pytest.raises(SystemExit) as e:
        mtm.main([str(tmp_path / "x"), "--vocab-size", "100"])
    assert e.value.code == 2
