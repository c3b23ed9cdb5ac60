"""An LLM judge (issue 43), as a unit test against a small OpenAI-compatible server of the test's own (the standard
library's http.server in a thread) that answers with log-probs: the request the judge sends, the yes-probability
score in [0, 1], the parsed score, and the failure rules. The live test against `vllm serve` is not here."""

import json
import math
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch  # noqa: F401  (the runner builds tensors)

pytest.importorskip("openai")

from lit_rlvr.rewards import build_reward_runner, reward_problems  # noqa: E402
from lit_rlvr.rewards.async_runner import AsyncRewardRunner  # noqa: E402


@pytest.fixture(scope="module")
def fake_openai():
    """/v1/chat/completions: completion "good" -> P(yes)=0.8, P(no)=0.2; "odd" -> neither among the top tokens;
    "boom" -> 500; text mode answers "... Score: 7"."""
    requests = []

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self):  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            requests.append((self.path, body))
            text = body["messages"][0]["content"]
            if "boom" in text:
                self.send_response(500)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            tops = ([("maybe", 0.6), ("perhaps", 0.4)] if "odd" in text else
                    [(" Yes", 0.5), ("yes", 0.3), ("No", 0.2)] if "good" in text else [("no", 0.9), ("yes", 0.1)])
            logprobs = {"content": [{"token": tops[0][0], "logprob": math.log(tops[0][1]), "bytes": None,
                                     "top_logprobs": [{"token": t, "logprob": math.log(p), "bytes": None}
                                                      for t, p in tops]}]} if body.get("logprobs") else None
            content = tops[0][0] if body.get("logprobs") else "Looks fine. Score: 7"
            answer = {"id": "x", "object": "chat.completion", "created": 0, "model": body["model"],
                      "choices": [{"index": 0, "finish_reason": "length", "logprobs": logprobs,
                                   "message": {"role": "assistant", "content": content}}]}
            data = json.dumps(answer).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *a):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1", requests
    server.shutdown()


def test_judge_yes_probability_from_logprobs(fake_openai):
    url, requests = fake_openai
    runner = build_reward_runner("judge", {"base_url": url, "model": "judge-m", "retries": 0, "timeout_s": 20})
    assert isinstance(runner, AsyncRewardRunner)
    batch = runner(["What is 2+2?"] * 4, ["good", "bad", "odd", "boom"], ["4"] * 4)
    runner.close()
    assert batch.scores.tolist() == pytest.approx([0.8, 0.1, 0.0, -1.0])
    assert batch.malformed.tolist() == [False, False, True, True]  # odd: no yes/no; boom: the API failed (counted)
    assert batch.failures == 1
    path, body = next(r for r in requests if "good" in r[1]["messages"][0]["content"])
    assert path == "/v1/chat/completions" and body["model"] == "judge-m" and body["max_tokens"] == 1
    assert body["logprobs"] is True and body["top_logprobs"] == 20 and body["temperature"] == 0.0
    assert "What is 2+2?" in body["messages"][0]["content"] and "Reference answer: 4" in body["messages"][0]["content"]


def test_judge_parsed_score_and_custom_template(fake_openai):
    url, requests = fake_openai
    runner = build_reward_runner("judge", {"base_url": url, "model": "m", "score": "parsed",
                                           "template": "Grade {completion} against {answer}"})
    batch = runner(["q"], ["an answer"], ["42"])
    runner.close()
    assert batch.scores.tolist() == pytest.approx([0.7]) and not batch.malformed.any()
    assert requests[-1][1]["messages"][0]["content"] == "Grade an answer against 42"


@pytest.mark.parametrize("options, line", [
    ({"model": "m"}, "reward=judge needs reward.options.base_url"),
    ({"base_url": "URL", "model": "m", "template": "{question}"}, "reward.options.template='{question}' is not "
                                                                  "valid: expected a string with {completion}"),
    ({"base_url": "URL", "model": "m", "template": "{completion"}, "reward.options.template='{completion' is not"),
    ({"base_url": "URL", "model": "m", "score": "prob"}, "reward.options.score='prob' is not valid"),
    ({"base_url": "URL", "model": "m", "top_logprobs": 50}, "reward.options.top_logprobs=50 is not valid"),
    ({"base_url": "http://127.0.0.1:1/v1", "model": "m"}, "reward.options.base_url='http://127.0.0.1:1/v1': the "
                                                          "server cannot be reached"),
    ({"base_url": "URL", "model": "???"}, "reward.options.model=??? is not valid: expected a value"),
    ({"base_url": "URL", "model": "m", "template": "{completion!z}"}, "reward.options.template='{completion!z}' is "
                                                                      "not valid: expected a format string that fills"),
    ({"base_url": "URL", "model": "m", "template": "{completion:%%}"}, "reward.options.template='{completion:%%}'"),
    ({"base_url": "URL", "model": "m", "timeout_s": -1}, "reward.options.timeout_s=-1 is not valid: expected a "
                                                         "number of seconds > 0"),
    ({"base_url": "URL", "model": "m", "max_token": 9}, "reward.options.max_token is not an option (did you mean "
                                                     "reward.options.max_tokens?)"),
])
def test_judge_settings_one_line_each(fake_openai, options, line):
    options = {k: fake_openai[0] if v == "URL" else v for k, v in options.items()}
    problems = reward_problems("judge", options)
    assert len(problems) == 1 and problems[0].startswith(line), problems


def test_a_token_counts_for_the_word_it_begins():
    """A tokenizer may split "yes"; the first token ("y", "Ye") is what one step returns. "yeah", "nope" and blanks
    count for neither."""
    from types import SimpleNamespace

    from lit_rlvr.rewards.judge import yes_probability

    def response(tops):
        content = [SimpleNamespace(top_logprobs=[SimpleNamespace(token=t, logprob=math.log(p)) for t, p in tops])]
        return SimpleNamespace(choices=[SimpleNamespace(logprobs=SimpleNamespace(content=content))])

    result = yes_probability(response([("y", 0.3), (" Ye", 0.1), ("N", 0.2), ("yeah", 0.2), (" ", 0.1), ("nope", 0.1)]))
    assert not result.malformed and result.score == pytest.approx(0.4 / 0.6)
    assert yes_probability(response([("yeah", 0.5), ("nope", 0.5)])).malformed
