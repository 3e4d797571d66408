#!/usr/bin/env python3
"""Make a tiny random-weight Llama model (plus a locally trained tokenizer) that vLLM can serve.

    python scripts/make_tiny_model.py OUT_DIR [--seed 0] [--vocab-size 512] [--force]

No network is used: the tokenizer is a byte-level BPE trained with the ``tokenizers`` library on a corpus
this script generates itself, and the model is a ``LlamaForCausalLM`` with seeded random weights.

Model: hidden_size 256, 4 attention heads (head_dim 64, a size vLLM's CPU attention supports), 2 KV heads,
intermediate_size 512, 2 layers, max_position_embeddings 4096, untied embeddings. Weights are stored in
bfloat16: with ``--dtype auto`` vLLM's CPU backend downcasts float32 checkpoints to bfloat16 anyway (the
first dtype in its supported list), so bfloat16 is what it serves; storing it halves the file and loading
needs no conversion. About 1.44 M parameters, about 2.9 MB of weights.

Tokenizer: byte-level BPE (any text encodes; no <unk> is ever produced) with special tokens
``<unk>`` = 0, ``<s>`` = 1 (bos), ``</s>`` = 2 (eos), ``<pad>`` = 3. Its post-processor prepends ``<s>`` to
every encoding, so ``tokenizer(text)["input_ids"][0] == 1`` for every prompt (pass
``add_special_tokens=False`` to get the bare tokens). Decoding with ``skip_special_tokens=True`` gives the
text back exactly. It carries a small chat template (``CHAT_TEMPLATE``: ``<s>``, then ``<|role|>`` headers with
each message's text ended by ``</s>``, then ``<|assistant|>`` for the reply), so ``/v1/chat/completions`` and
``vllm bench serve --backend openai-chat`` work on it; conversations sharing a system prompt share a token prefix.

Deterministic: the same arguments give byte-identical files (with the same library versions).
Idempotent: OUT_DIR/p2pnode_tiny.json fingerprints the parameters and the files' sha256; when it matches, the
script says so and exits 0 without importing torch (unless --force). The model is built in a temporary
directory beside OUT_DIR and renamed into place.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

# Bump when the output for the same parameters changes.
SCRIPT_VERSION = 2
FINGERPRINT = "p2pnode_tiny.json"

ARCH = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-5,
    "dtype": "bfloat16",
}

UNK, BOS, EOS, PAD = "<unk>", "<s>", "</s>", "<pad>"
#: A Jinja chat template in the HF convention (messages, add_generation_prompt, bos_token, eos_token). The role
#: headers are plain text (the BPE encodes any text); the content is a string (vLLM flattens text parts).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + eos_token + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)
SPECIAL_TOKENS = [UNK, BOS, EOS, PAD]  # ids 0, 1, 2, 3
# 256 byte-level symbols + the special tokens.
MIN_VOCAB = 256 + len(SPECIAL_TOKENS)

PARAGRAPHS = [
    "A decentralized serving mesh lets every node answer requests on its own. Each node runs an inference "
    "engine, keeps a cache of the attention keys and values it has already computed, and tells its peers "
    "which prompt prefixes it holds. A request that shares a long prefix with earlier work is routed to the "
    "node that still has that prefix in memory, so the engine can skip most of the prefill.",
    "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. How vexingly "
    "quick daft zebras jump! Sphinx of black quartz, judge my vow. The five boxing wizards jump quickly.",
    "Once upon a time there was a small village at the edge of a great forest. The people of the village "
    "baked bread, mended nets and told stories in the evening. One winter a traveller arrived with a box of "
    "maps, and the children asked him where the roads would lead if one followed them to the end.",
    "You are a helpful assistant. Answer the question below in one short paragraph, and say so when you do "
    "not know the answer. Question: What is the capital of France? Answer: The capital of France is Paris.",
    "def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n"
    "for i in range(10):\n    print(i, fib(i))\n",
    "Numbers and symbols: 0 1 2 3 4 5 6 7 8 9 10 42 100 1024 3.14159 -7 +12 (a, b) [x] {y} <z> #tag @user "
    "$5.00 50% a/b c\\d e|f ~g `h` 'single' \"double\" under_score dash-ed colon: semi; end.",
    "Caches work best when requests repeat. A system prompt that every conversation starts with, a long "
    "document that many questions refer to, or a few-shot template with examples are all shared prefixes. "
    "Blocks of tokens are hashed in a chain, so two prompts share cached blocks up to their first "
    "difference.",
]

WORDS = (  # noqa: SIM905 (a word list is easier to read as one string)
    "the of and to in is that for it as with was on be by at this from or an are not have which one you "
    "all were they her she there been their has when who will more no if out so said what up its about "
    "into than them can only other new some time could these two may then do first any my now such like "
    "our over man me even most made after also did many before must through back years where much your way "
    "well down should because each just those people how too little state good very make world still own "
    "see men work long get here between both life being under never day same another know while last might "
    "us great old year off come since against go came right used take three node cache prefix token block "
    "engine request route peer mesh model serve prompt memory hash gossip cluster secret key value layer "
    "attention query batch stream latency throughput"
).split()


def corpus(seed: int) -> list[str]:
    """A deterministic training corpus: the paragraphs above plus seeded pseudo-random word sequences."""
    rng = random.Random(seed)
    lines = list(PARAGRAPHS)
    for _ in range(400):
        n = rng.randint(6, 24)
        words = [rng.choice(WORDS) for _ in range(n)]
        if rng.random() < 0.5:
            words[0] = words[0].capitalize()
        sep = rng.choice([". ", "? ", "! ", ", ", ".\n"])
        lines.append(" ".join(words) + sep.rstrip(" "))
    return lines


def parameters(seed: int, vocab_size: int) -> dict:
    return {
        "seed": seed,
        "vocab_size": vocab_size,
        "arch": ARCH,
        "special_tokens": SPECIAL_TOKENS,
        "chat_template": CHAT_TEMPLATE,
    }


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def hash_files(directory: Path) -> dict[str, str]:
    return {
        p.name: sha256_file(p) for p in sorted(directory.iterdir()) if p.is_file() and p.name != FINGERPRINT
    }


def read_fingerprint(directory: Path) -> dict | None:
    try:
        return json.loads((directory / FINGERPRINT).read_text())
    except (OSError, ValueError):
        return None


def up_to_date(directory: Path, params: dict) -> bool:
    """True when directory holds a build of these parameters by this script version, files intact."""
    fp = read_fingerprint(directory)
    if not fp or fp.get("script_version") != SCRIPT_VERSION or fp.get("params") != params:
        return False
    files = fp.get("files")
    if not isinstance(files, dict) or "model.safetensors" not in files:
        return False
    try:
        return hash_files(directory) == files
    except OSError:
        return False


def build_tokenizer(seed: int, vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(seed), trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A",
        pair=f"{BOS} $A {BOS}:1 $B:1",
        special_tokens=[(BOS, bos_id)],
    )
    return tok


def build(out_tmp: Path, seed: int, vocab_size: int) -> int:
    """Write the model and tokenizer into out_tmp; returns the parameter count."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()

    tok = build_tokenizer(seed, vocab_size)
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    if tok.get_vocab_size() > vocab_size:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} tokens, more than vocab {vocab_size}")
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        pad_token=PAD,
        model_max_length=ARCH["max_position_embeddings"],
        clean_up_tokenization_spaces=False,
    )
    hf_tok.chat_template = CHAT_TEMPLATE
    hf_tok.save_pretrained(str(out_tmp))

    arch = dict(ARCH)
    dtype = getattr(torch, arch.pop("dtype"))
    config = LlamaConfig(
        vocab_size=vocab_size,
        bos_token_id=ids[BOS],
        eos_token_id=ids[EOS],
        pad_token_id=ids[PAD],
        **arch,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    # Small-std init (initializer_range); make it explicit in case a library version skips _init_weights.
    with torch.no_grad():
        gen = torch.Generator().manual_seed(seed)
        for name, p in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * ARCH["initializer_range"])
    model = model.to(dtype)
    model.config.dtype = dtype
    model.eval()
    model.save_pretrained(str(out_tmp))
    return sum(p.numel() for p in model.parameters())


def check_reproducible_text(directory: Path) -> None:
    """json files must not carry anything that varies between runs (timestamps, paths)."""
    for p in directory.glob("*.json"):
        text = p.read_text()
        for needle in (str(directory), time.strftime("%Y-%m-%d")):
            if needle in text:
                raise RuntimeError(f"{p.name} contains a run-specific string {needle!r}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir", type=Path, help="directory to write the model into")
    ap.add_argument("--seed", type=int, default=0, help="random seed for weights and tokenizer corpus")
    ap.add_argument("--vocab-size", type=int, default=512, help=f"vocabulary size (>= {MIN_VOCAB})")
    ap.add_argument("--force", action="store_true", help="rebuild even when OUT_DIR is up to date")
    args = ap.parse_args(argv)
    if args.vocab_size < MIN_VOCAB:
        ap.error(f"--vocab-size must be at least {MIN_VOCAB}")

    out = args.out_dir.resolve()
    params = parameters(args.seed, args.vocab_size)
    if not args.force and up_to_date(out, params):
        print(f"tiny model: {out} is up to date (seed {args.seed}, vocab {args.vocab_size})")
        return 0
    foreign = out.exists() and (not out.is_dir() or (any(out.iterdir()) and read_fingerprint(out) is None))
    if foreign and not args.force:
        print(
            f"error: {out} exists and is not a tiny model made by this script; use --force", file=sys.stderr
        )
        return 2

    for var, val in (
        ("HF_HUB_OFFLINE", "1"),
        ("TRANSFORMERS_OFFLINE", "1"),
        ("HF_HUB_DISABLE_TELEMETRY", "1"),
        ("HF_HUB_DISABLE_PROGRESS_BARS", "1"),
        ("TOKENIZERS_PARALLELISM", "false"),
        ("TRANSFORMERS_VERBOSITY", "error"),
    ):
        os.environ.setdefault(var, val)

    t0 = time.monotonic()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        n_params = build(tmp, args.seed, args.vocab_size)
        check_reproducible_text(tmp)
        fingerprint = {
            "script": "scripts/make_tiny_model.py",
            "script_version": SCRIPT_VERSION,
            "params": params,
            "num_parameters": n_params,
            "files": hash_files(tmp),
        }
        (tmp / FINGERPRINT).write_text(json.dumps(fingerprint, indent=2, sort_keys=True) + "\n")
        for p in tmp.iterdir():
            os.chmod(p, 0o644)
        os.chmod(tmp, 0o755)
        # Swap into place: move any old directory aside, rename the new one in, then delete the old one.
        old = None
        if out.exists() or out.is_symlink():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            os.rename(out, old / "d")
        try:
            os.rename(tmp, out)
        except OSError:
            # Someone else (a concurrent run) put a directory there first: fine if it is the same build.
            if up_to_date(out, params):
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                if old is not None and not out.exists():
                    os.rename(old / "d", out)
                    shutil.rmtree(old, ignore_errors=True)
                raise
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise

    print(
        f"tiny model: {out} ({n_params:,} params, vocab {args.vocab_size}, {ARCH['dtype']}, "
        f"seed {args.seed}) built in {time.monotonic() - t0:.1f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
