"""A stand-in for `sglang.launch_server`, for CPU tests of kdtree's server check (`kdtree.server`): SGLang's server
needs a CUDA GPU, which CI does not have. It stands in for SGLang's HTTP side and its log, not for anything kdtree
computes; the real server runs in the GPU tests (tests/test_server_gpu.py).

Like SGLang's launcher it spawns a child (its "scheduler") in its own process group, answers `/model_info`,
`/generate`, `/v1/completions` and `/v1/chat/completions` on loopback, and prints what SGLang and kdtree's backend
print for the mode in KDTREE_MODE: shadow lines (rel from STANDIN_REL), the target-verify CUDA-graph capture
line and kdtree's serve lines (serve, triton), a capture file per request (capture: a synthetic capture written by
kdtree's own writer into KDTREE_CAPTURE_DIR). For the server bench it answers `/start_profile` (in plain text, as
SGLang does) and `/stop_profile`, and keeps a clock: a request of n tokens takes n // 2 verify steps of
STANDIN_STEP_MS each plus STANDIN_REQUEST_MS once, and the trace `/stop_profile` writes holds, per step since
`/start_profile`, STANDIN_ATTENTION_US of an attention kernel and STANDIN_GEMM_US of another, plus a one-off
kernel per request.

With `--tp N` it prints as N ranks would: a shadow line of each rank KDTREE_RANKS names (`all`, or `0` by
default) as kdtree's backend prints it above TP 1 (`[kdtree] TP<r> L<layer> ...`), and a capture file per such
rank (`-tp<r>`).

Usage: python server_standin.py PORT [--delay S] [--exit-early CODE] [--ignore-sigterm] [--never-ready] [--slow S]
       [--die-mid-reply] [--tp N]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import signal
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def scheduler(ignore_sigterm: bool) -> None:
    if ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    while True:
        time.sleep(1)


_lock = threading.Lock()


def say(line: str) -> None:
    with _lock:
        print(line, flush=True)


def ranks(tp: int) -> list[int]:
    """The ranks that print and capture: KDTREE_RANKS as kdtree's backend reads it (`all` or ids)."""
    named = os.environ.get("KDTREE_RANKS", "0")
    return list(range(tp)) if named == "all" else [r for r in map(int, named.split(",")) if r < tp]


class Handler(BaseHTTPRequestHandler):
    mode = "serve"
    tp = 1
    served = 0
    slow = 0.0  # seconds each /generate takes
    die_mid_reply = False

    def log_message(self, *args):  # quiet, as SGLang's access log is off
        pass

    def _send(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/model_info":
            self._send(200, {"model_path": "standin"})
        else:
            self._send(404, {})

    profile_dir = None
    profiled_steps = 0
    profiled_requests = 0

    def do_POST(self):
        payload = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        with _lock:
            Handler.served += 1
            index = Handler.served
        if self.path == "/start_profile":
            Handler.profile_dir, Handler.profiled_steps, Handler.profiled_requests = payload["output_dir"], 0, 0
            self._send_text("Start profiling.\n")
        elif self.path == "/stop_profile":
            self._write_trace()
            self._send_text("Stop profiling. This will take some time.\n")
        elif self.path == "/generate":
            n = payload["sampling_params"]["max_new_tokens"]
            steps = max(1, n // 2)
            time.sleep(
                float(os.environ.get("STANDIN_REQUEST_MS", 0)) / 1e3 + steps * float(os.environ.get("STANDIN_STEP_MS", 0)) / 1e3
            )
            with _lock:
                Handler.profiled_steps = max(Handler.profiled_steps, steps)  # the batch's steps: its longest request's
                Handler.profiled_requests += 1
            if self.die_mid_reply:  # headers and half a body, then the whole server dies
                self.send_response(200)
                self.send_header("Content-Length", "1000")
                self.end_headers()
                self.wfile.write(b'{"text": "')
                self.wfile.flush()
                os._exit(1)
            time.sleep(self.slow)
            self._on_request(index)
            text = payload["text"][::-1][:n] if "text" in payload else "x" * n
            self._send(200, {"text": text, "output_ids": list(range(n)),
                             "meta_info": {"completion_tokens": n, "spec_verify_ct": steps, "spec_accept_length": 2.0}})  # fmt: skip
        elif self.path == "/v1/completions":
            self._send(200, {"choices": [{"text": "ok"}]})
        elif self.path == "/v1/chat/completions":
            self._send(200, {"choices": [{"message": {"content": "ok"}}]})
        else:
            self._send(404, {})

    def _send_text(self, text: str) -> None:
        data = text.encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _write_trace(self) -> None:
        if Handler.profile_dir is None:
            return
        import gzip

        steps, requests = Handler.profiled_steps, Handler.profiled_requests
        per_step = [
            ("_fwd_kernel", float(os.environ.get("STANDIN_ATTENTION_US", 0))),
            ("nvjet_gemm", float(os.environ.get("STANDIN_GEMM_US", 0))),
        ]
        events = [{"ph": "X", "cat": "kernel", "name": n, "dur": us} for _ in range(steps) for n, us in per_step]
        events += [{"ph": "X", "cat": "kernel", "name": "one_off_extend", "dur": 5000.0} for _ in range(requests)]
        os.makedirs(Handler.profile_dir, exist_ok=True)
        with gzip.open(os.path.join(Handler.profile_dir, f"{time.time()}-TP-0.trace.json.gz"), "wt") as f:
            json.dump({"traceEvents": events}, f)
        Handler.profile_dir = None

    def _on_request(self, index: int) -> None:
        rel = os.environ.get("STANDIN_REL", "1.2e-03")
        if self.mode == "shadow":
            for rank in ranks(self.tp):
                for layer in (0, 1):
                    who = f"TP{rank} " if self.tp > 1 else ""  # as kdtree's backend prints it
                    say(f"[kdtree] {who}L{layer} max_abs_diff=3.9062e-03 mean=3.7e-05 rel={rel}")
        elif self.mode == "serve":
            say("[kdtree] serving: first verify step kdtree served (batch 1, 16 draft tokens, 8 heads)")
            say("[kdtree] serving: replaying CUDA graphs kdtree captured (batch size 1 first)")
        elif self.mode == "capture":
            from kdtree.capture import save
            from kdtree.synth import SynthSpec, synthesize

            directory = os.environ["KDTREE_CAPTURE_DIR"]
            os.makedirs(directory, exist_ok=True)
            cap = synthesize(SynthSpec(batch_size=1, prefix_lens=[40], tree="chain", num_draft_tokens=4, seed=index))
            for rank in ranks(self.tp):
                cap.meta.tp_rank, cap.meta.tp_size = rank, self.tp  # what the backend records of its rank
                save(cap, os.path.join(directory, f"step{index:06d}-L0-tp{rank}.safetensors"), private=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("port", type=int)
    ap.add_argument("--delay", type=float, default=0.5)
    ap.add_argument("--exit-early", type=int, default=None)
    ap.add_argument("--ignore-sigterm", action="store_true")
    ap.add_argument("--never-ready", action="store_true")
    ap.add_argument("--slow", type=float, default=0.0)
    ap.add_argument("--die-mid-reply", action="store_true")
    ap.add_argument("--tp", type=int, default=1)
    args = ap.parse_args()
    Handler.slow, Handler.die_mid_reply, Handler.tp = args.slow, args.die_mid_reply, args.tp
    child = multiprocessing.get_context("spawn").Process(target=scheduler, args=(args.ignore_sigterm,))
    child.start()
    if args.ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    Handler.mode = os.environ.get("KDTREE_MODE", "serve")
    say(f"[kdtree] attention backend kdtree, mode {Handler.mode} (KDTREE_MODE)")
    if Handler.mode == "serve":  # the backend's self-check, before any step (STANDIN_SELFCHECK: its verdict)
        if os.environ.get("STANDIN_SELFCHECK", "passed") == "passed":
            say("[kdtree] self-check passed on the stand-in GPU (cached)")
        else:
            say("[kdtree] kdtree's self-check FAILED on the stand-in GPU (fuzz seed 17: rel 9.00e-01 > 0.01); Triton serves")
    time.sleep(args.delay)
    if args.exit_early is not None:
        say("Traceback (most recent call last):\nRuntimeError: the stand-in was told to exit early")
        os._exit(args.exit_early)  # no atexit join: its scheduler child is left running, as after a crash
    if args.never_ready:
        while True:
            time.sleep(1)
    if Handler.mode in ("serve", "triton"):
        say("Capture target verify CUDA graph end. bs=[1, 2, 3, 4], elapsed=1.00 s, mem usage=0.01 GB")
    ThreadingHTTPServer(("127.0.0.1", args.port), Handler).serve_forever()


if __name__ == "__main__":
    main()
