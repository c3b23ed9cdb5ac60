"""A reward server speaking OpenRLHF's `/get_reward` protocol, on the standard library's `http.server`: POST
{"query": [prompt + completion], "prompts": [...], "labels": [...]} -> {"rewards": [...], "scores": [...]}.

    python examples/reward_server.py --port 5000 --reward arithmetic
    python train.py reward=remote reward.options.url=http://127.0.0.1:5000

`--reward` is any lit-rlvr reward (a built-in name or package.module:function). The tests start it with
`--port 0` (it prints the port it got) and the fault modes: `--mode slow` (answers after --delay-s seconds),
`garbage` (answers with text that is not JSON, or with the wrong length), `die-after N` (exits after N requests).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from lit_rlvr.rewards import resolve_reward
from lit_rlvr.rewards.base import RewardResult


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=5000)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--reward", default="arithmetic")
    parser.add_argument("--mode", default="ok", choices=["ok", "slow", "garbage", "die-after"])
    parser.add_argument("--delay-s", type=float, default=0.0)
    parser.add_argument("--n", type=int, default=1, help="die-after: requests answered before the process exits")
    args = parser.parse_args()
    reward = resolve_reward(args.reward)
    served = [0]

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            if args.mode == "die-after" and served[0] >= args.n:
                os._exit(0)  # mid-run: the connection drops, later ones are refused
            served[0] += 1
            data = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            if args.mode == "slow":
                time.sleep(args.delay_s)
            if args.mode == "garbage":
                body = b"<html>not json</html>" if served[0] % 2 else json.dumps({"rewards": [1.0]}).encode()
            else:
                scores = []
                for query, prompt, label in zip(data["query"], data["prompts"], data["labels"]):
                    completion = query[len(prompt):] if isinstance(prompt, str) else query
                    result = reward(prompt, completion, label)
                    scores.append(result.score if isinstance(result, RewardResult) else float(result))
                body = json.dumps({"rewards": scores, "scores": scores}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a) -> None:
            pass

    server = ThreadingHTTPServer((args.host, args.port), Handler)
    print(server.server_address[1], flush=True)
    sys.stdout.close()
    server.serve_forever()


if __name__ == "__main__":
    main()
