"""A SandboxFusion-compatible `run_code` server for tests/test_rewards_sandbox_url.py: it runs each program in
the project's own local sandbox (lit_rlvr.rewards.code.run_program). `python tests/sandbox_server.py` prints the
port it got; GET /stats answers {"requests": n, "most_in_flight": k}."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from lit_rlvr.rewards.code import Limits, run_program

STATUS = {"ok": "Finished", "timeout": "TimeLimitExceeded", "memory": "Finished", "runtime_error": "Finished",
          "output_limit": "Finished"}
lock, stats, now = threading.Lock(), {"requests": 0, "most_in_flight": 0}, [0]


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def _send(self, answer):
        data = json.dumps(answer).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):  # noqa: N802
        with lock:
            self._send(dict(stats))

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with lock:
            stats["requests"] += 1
            now[0] += 1
            stats["most_in_flight"] = max(stats["most_in_flight"], now[0])
        try:
            limits = Limits(timeout_s=float(body["run_timeout"]), memory_mb=int(body["memory_limit_MB"]))
            res = run_program(body["code"], body.get("stdin", ""), limits=limits)
        finally:
            with lock:
                now[0] -= 1
        if res.status == "sandbox_error":
            return self._send({"status": "SandboxError", "message": res.stderr[-300:], "run_result": None})
        self._send({"status": "Success" if res.status == "ok" else "Failed", "message": "", "compile_result": None,
                    "run_result": {"status": STATUS[res.status], "execution_time": res.wall_s,
                                   "return_code": res.returncode, "stdout": res.stdout, "stderr": res.stderr},
                    "files": {}})

    def log_message(self, *a):
        pass


if __name__ == "__main__":
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    print(server.server_address[1], flush=True)
    server.serve_forever()
