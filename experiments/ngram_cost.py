"""What SGLang's NGRAM drafter costs the host a verify step, apart from the server: its n-gram corpus
(`sglang.srt.speculative.cpp_ngram.ngram_corpus.NgramCorpus`, the C++ trie SGLang JIT-builds) fed and queried as
its worker does once a step - the last 18 tokens of each request put in, then a draft of N tokens matched for
each request of the batch - on token streams shaped like the server bench's (a greedy random model that loops).

`kdtree bench --server` found 1.4-3.7 ms a step that the GPU does not account for, in kdtree's server and
Triton's alike; this says how much of it is the drafter's matching (the rest: the scheduler, HTTP, detokenizing).

Usage (a machine with SGLang and its JIT toolchain; no GPU work): python3 experiments/ngram_cost.py [OUT.json]
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import numpy as np

DEPTH = 18  # SGLang's --speculative-ngram-max-trie-depth default
STEPS = 200


def stream(rng: np.random.Generator, period: int, draft: int) -> list[int]:
    """A request's tokens: a prompt tail, then a loop of `period` tokens (what the tiny model's greedy text does),
    long enough for STEPS steps that each accept up to `draft` tokens."""
    loop = rng.integers(3, 500, size=period).tolist()
    return rng.integers(3, 500, size=DEPTH).tolist() + loop * ((STEPS * draft) // period + 1)


def one(batch: int, draft: int, breadth: int = 4) -> dict:
    from sglang.srt.speculative.cpp_ngram.ngram_corpus import NgramCorpus

    corpus = NgramCorpus(max_trie_depth=DEPTH, min_bfs_breadth=1, max_bfs_breadth=breadth, draft_token_num=draft)
    rng = np.random.default_rng(batch * 1000 + draft)
    streams = [stream(rng, int(rng.integers(1, 9)), draft) for _ in range(batch)]
    ids = [f"r{i}" for i in range(batch)]
    put_us, get_us, pos = [], [], [DEPTH] * batch
    for _ in range(STEPS):
        t0 = time.perf_counter()
        corpus.batch_put([s[p - DEPTH : p] for s, p in zip(streams, pos)])
        corpus.synchronize()
        t1 = time.perf_counter()
        corpus.batch_get(ids, [s[p - DEPTH : p] for s, p in zip(streams, pos)], pos)
        t2 = time.perf_counter()
        put_us.append(1e6 * (t1 - t0))
        get_us.append(1e6 * (t2 - t1))
        pos = [p + int(rng.integers(1, draft + 1)) for p in pos]  # accepted tokens this step
    return {
        "batch": batch,
        "draft_tokens": draft,
        "put_us_median": statistics.median(put_us),
        "match_us_median": statistics.median(get_us),
        "step_us_median": statistics.median(a + b for a, b in zip(put_us, get_us)),
    }


def main() -> None:
    rows = [one(b, n) for n in (16, 64) for b in (1, 4, 16)]
    for r in rows:
        print(
            f"batch {r['batch']:>2}  draft {r['draft_tokens']:>2}: put {r['put_us_median']:7.1f} us  "
            f"match {r['match_us_median']:7.1f} us  a step {r['step_us_median']:7.1f} us"
        )
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
