"""Greedy requests to an SGLang server over HTTP (stdlib only), and prompts that make NGRAM speculation draft.

NGRAM drafts from an n-gram trie of the text it has seen, so prompts that repeat themselves (and share openings:
radix-cache hits) give it something to draft from; with random weights the continuation is noise, which is what
the shadow diff and the agreement rate are robust to."""

from __future__ import annotations

import http.client
import json
import random
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

SENTENCES = [
    "the quick brown fox jumps over the lazy dog",
    "one two three four five six seven eight nine ten",
    "speculative decoding drafts a tree and the target verifies it",
    "a kernel engineer reads the mask row by row",
    "def verify(tree, prefix): return [node for node in tree]",
    "kimi and deepseek share one attention: q and k of 576, v of 512",
]
OPENINGS = ["Repeat after me: ", "Count again: ", "Once more, slowly: ", ""]


def prompts(count: int, *, seed: int = 0, repeats: int = 3, min_chars: int = 0) -> list[str]:
    """`count` prompts, each a few sentences repeated `repeats` times (NGRAM matches them), about a third sharing
    an opening with an earlier one (radix-cache hits); each grown to at least `min_chars` characters."""
    rng = random.Random(seed)
    out: list[str] = []
    for i in range(count):
        body = ". ".join(rng.sample(SENTENCES, k=rng.randint(1, 3)))
        text = OPENINGS[i % len(OPENINGS)] + ". ".join([body] * repeats) + "."
        if out and i % 3 == 2:
            text = out[i - 1][: len(out[i - 1]) // 2] + " " + text  # shares the previous prompt's first half
        while len(text) < min_chars:
            text += " " + rng.choice(SENTENCES) + "."
        out.append(text)
    return out


STEMS = {  # one opening, several continuations: an n-gram trie that branches after the opening
    "the quick brown": [" fox jumps over the lazy dog", " cat sleeps under the old tree", " bear eats honey all day"],
    "one two three": [" four five six", " go go go", " and the count stops here"],
    "the kernel reads": [" the prefix keys first", " the draft nodes last", " the mask row by row"],
}


def branching_prompts(count: int, *, seed: int = 0, repeats: int = 4) -> list[str]:
    """Prompts in which each opening is followed by different continuations, repeated: NGRAM's trie then holds
    several children of a node, and its drafts are trees rather than chains."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        parts = [stem + rng.choice(ends) for stem, ends in STEMS.items() for _ in range(repeats)]
        rng.shuffle(parts)
        out.append(". ".join(parts) + ". the quick brown")
    return out


@dataclass
class Reply:
    """One request's outcome: answered or not, what came back, and SGLang's speculative counters."""

    prompt_index: int
    ok: bool
    status: int | None = None
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    completion_tokens: int = 0
    spec_verify_ct: int = 0
    spec_accept_length: float | None = None
    seconds: float = 0.0
    error: str | None = None

    def to_json(self) -> dict:
        return asdict(self)


def post_json(url: str, payload: dict, timeout: float) -> tuple[int, dict]:
    """POST `payload` as JSON; (status, the JSON answer: {} when there is none, {"text": ...} when it is not JSON,
    as SGLang's /start_profile answers)."""
    req = urllib.request.Request(url, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        body = r.read()
    if not body.strip():
        return r.status, {}
    try:
        return r.status, json.loads(body)
    except json.JSONDecodeError:
        return r.status, {"text": body.decode(errors="replace")}


def generate(base_url: str, prompt: str | list[int], *, max_new_tokens: int, index: int = 0, timeout: float = 300.0) -> Reply:
    """POST /generate with text or token ids, greedy (temperature 0, EOS ignored so every request decodes
    `max_new_tokens`)."""
    payload = {
        "text" if isinstance(prompt, str) else "input_ids": prompt,
        "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True},
    }
    t0 = time.monotonic()
    try:
        status, body = post_json(base_url + "/generate", payload, timeout)
    except urllib.error.HTTPError as e:
        return Reply(index, False, e.code, error=f"HTTP {e.code}: {e.read()[:300]!r}", seconds=time.monotonic() - t0)
    except (urllib.error.URLError, OSError, ValueError, http.client.HTTPException) as e:  # e.g. the server died mid-reply
        return Reply(index, False, error=f"{type(e).__name__}: {e}", seconds=time.monotonic() - t0)
    meta = body.get("meta_info", {})
    return Reply(
        index,
        ok=status == 200 and meta.get("completion_tokens", 0) > 0,
        status=status,
        text=body.get("text", ""),
        output_ids=list(body.get("output_ids") or []),
        completion_tokens=int(meta.get("completion_tokens", 0)),
        spec_verify_ct=int(meta.get("spec_verify_ct", 0) or 0),
        spec_accept_length=meta.get("spec_accept_length"),
        seconds=time.monotonic() - t0,
    )


def cancel_midway(base_url: str, prompt: str, *, max_new_tokens: int, after_chunks: int = 2, timeout: float = 120.0) -> int:
    """A streamed /generate closed after `after_chunks` chunks (a client that goes away mid-generation); the
    chunks read."""
    payload = {
        "text": prompt,
        "stream": True,
        "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True},
    }
    req = urllib.request.Request(
        base_url + "/generate", data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"}
    )
    read = 0
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for line in r:
            if line.startswith(b"data:"):
                read += 1
                if read >= after_chunks:
                    break
    return read


def openai_probe(base_url: str, *, max_tokens: int = 16, timeout: float = 120.0) -> dict[str, bool]:
    """One greedy /v1/completions and one /v1/chat/completions call: whether each answered with text."""
    out = {}
    calls = {
        "/v1/completions": {"model": "default", "prompt": prompts(1)[0], "max_tokens": max_tokens, "temperature": 0},
        "/v1/chat/completions": {
            "model": "default",
            "messages": [{"role": "user", "content": prompts(2)[1]}],
            "max_tokens": max_tokens,
            "temperature": 0,
        },
    }
    for path, payload in calls.items():
        try:
            status, body = post_json(base_url + path, payload, timeout)
            choice = (body.get("choices") or [{}])[0]
            text = choice.get("text") or (choice.get("message") or {}).get("content")
            out[path] = status == 200 and bool(text)
        except (urllib.error.URLError, OSError, ValueError, http.client.HTTPException):
            out[path] = False
    return out


def drive(
    base_url: str,
    texts: list[str] | list[list[int]],
    *,
    concurrency: int,
    max_new_tokens: int,
    timeout: float = 300.0,
    first_index: int = 0,
) -> list[Reply]:
    """Send every prompt, `concurrency` at a time; replies in prompt order, `prompt_index` counted from
    `first_index` (the prompts' place in a longer list sent in parts)."""
    pool = ThreadPoolExecutor(max_workers=max(1, concurrency))
    try:
        futures = [
            pool.submit(generate, base_url, t, max_new_tokens=max_new_tokens, index=first_index + i, timeout=timeout)
            for i, t in enumerate(texts)
        ]
        return [f.result() for f in futures]
    finally:  # on Ctrl-C or SIGTERM: drop the queued requests, do not wait for those in flight
        pool.shutdown(wait=False, cancel_futures=True)
