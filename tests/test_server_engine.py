"""Server engines (lit_rlvr/rollout/server.py, vllm_server.py) against stand-in servers on 127.0.0.1 that answer
vLLM's routes as the installed vLLM does (the real servers: tests/test_servers_live.py): requests spread over the
servers with a group on one, a server that stops answering is given up and its requests go to the others, none
left stops with every URL named, a server of another model or kind is refused before any work, and a push pauses,
updates and resumes every server, in that order, with the weights the trainer holds."""

from __future__ import annotations

import gc
import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

import pytest
import torch
from safetensors.torch import load_file

from lit_rlvr.config.errors import ConfigError, HTTPRefusal
from lit_rlvr.models.tiny import build_tiny
from lit_rlvr.rollout.engine import EngineError, SamplingParams
from lit_rlvr.rollout.server import url_problems
from lit_rlvr.rollout.vllm_server import VLLMServerEngine
from lit_rlvr.rollout.weights import push_weights

MODEL_PATH = "/models/tiny"


class FakeVLLM(ThreadingHTTPServer):
    """Answers vLLM 0.32's routes; each sample's tokens are (seed % 7, 3) with log-prob -0.25 each."""

    daemon_threads = True

    def __init__(self, model_path: str = MODEL_PATH, owned_by: str = "vllm"):
        super().__init__(("127.0.0.1", 0), Handler)
        self.model_path, self.owned_by = model_path, owned_by
        self.calls: list[str] = []
        self.generated: list[list[int]] = []  # the prompts it sampled
        self.loaded: dict[str, torch.Tensor] = {}
        self.fail_route: str = ""
        self.fail_after = 0  # calls of fail_route that succeed before it fails
        self.misbehave: dict = {}  # route -> fn(handler): answers that route as a hostile server would
        self.thread = threading.Thread(target=self.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def kill(self) -> None:
        self.shutdown()
        self.server_close()


class Handler(BaseHTTPRequestHandler):
    server: FakeVLLM

    def log_message(self, *args) -> None:
        pass

    def _answer(self, status: int, body) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path in self.server.misbehave:
            return self.server.misbehave[self.path](self)
        if self.path == "/v1/models":
            return self._answer(200, {"data": [{"id": self.server.model_path, "root": self.server.model_path,
                                                "owned_by": self.server.owned_by}]})
        self._answer(404, {"detail": "Not Found"})

    def do_POST(self) -> None:
        route = urlsplit(self.path).path
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"null")
        self.server.calls.append(route)
        if route in self.server.misbehave:
            return self.server.misbehave[route](self)
        if route == self.server.fail_route and self.server.calls.count(route) > self.server.fail_after:
            return self._answer(500, {"error": "broken"})
        if route == "/inference/v1/generate":
            self.server.generated.append(body["token_ids"])
            ids = [body["sampling_params"]["seed"] % 7, 3]
            return self._answer(200, {"request_id": "r", "choices": [{
                "index": 0, "token_ids": ids, "finish_reason": "stop",
                "logprobs": {"content": [{"token_id": t, "logprob": -0.25} for t in ids]}}]})
        if route == "/start_weight_update":
            self.server.loaded = {}
        if route == "/update_weights":  # one call per bucket file
            self.server.loaded.update(load_file(body["update_info"]["path"]))
        self._answer(200, {"message": "ok"})


@pytest.fixture
def policy():
    model, tokenizer = build_tiny(0, hidden_size=32, heads=2)
    model.config._name_or_path = MODEL_PATH
    return model, tokenizer


@pytest.fixture
def servers():
    made = [FakeVLLM(), FakeVLLM()]
    yield made
    for server in made:
        if server.thread.is_alive():
            server.kill()


def _engine(policy, servers, **options) -> VLLMServerEngine:
    model, tokenizer = policy
    return VLLMServerEngine(model, tokenizer, urls=[s.url for s in servers], connect_timeout_s=2.0, **options)


def test_samples_spread_over_servers_a_group_on_one(policy, servers):
    engine = _engine(policy, servers)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    out = engine.generate(prompts, [2, 3, 1], SamplingParams(temperature=1.0, max_new_tokens=4, seed=1))
    assert [len(c) for c in out] == [2, 3, 1]
    assert all(c.token_ids[-1] == 3 and torch.allclose(c.logprobs, torch.full((2,), -0.25)) and
               c.finish_reason == "stop" for per in out for c in per)
    holders = [{i for i, s in enumerate(servers) if p in s.generated} for p in prompts]
    assert all(len(h) == 1 for h in holders), holders  # each group on one server
    assert set().union(*holders) == {0, 1}  # both servers busy
    again = engine.generate(prompts, [2, 3, 1], SamplingParams(temperature=1.0, max_new_tokens=4, seed=1))
    tokens = [[c.token_ids.tolist() for c in per] for per in out]
    assert [[c.token_ids.tolist() for c in per] for per in again] == tokens  # seeds per sample, not per server
    assert engine.take_metrics() == {"engine/servers_alive": 2.0, "engine/requests_retried": 0.0}
    engine.shutdown()


def test_a_server_gone_its_requests_go_to_the_others(policy, servers):
    engine = _engine(policy, servers)
    servers[1].kill()
    out = engine.generate([[5, 6], [7, 8], [9, 10]], [2, 2, 2], SamplingParams(max_new_tokens=4, seed=2))
    assert sum(len(c) for c in out) == 6
    metrics = engine.take_metrics()
    assert metrics["engine/servers_alive"] == 1.0 and metrics["engine/requests_retried"] >= 1
    assert engine.take_metrics()["engine/requests_retried"] == 0.0  # counted since the last take
    engine.shutdown()


def test_every_server_gone_names_them_all(policy, servers):
    engine = _engine(policy, servers)
    for server in servers:
        server.kill()
    with pytest.raises(EngineError, match="every rollout server is gone") as info:
        engine.generate([[5, 6]], [2], SamplingParams(max_new_tokens=4))
    assert all(s.url in str(info.value) for s in servers)
    engine.shutdown()


def test_a_server_of_another_model_or_kind_is_refused_before_any_work(policy):
    other, sglang_like = FakeVLLM(model_path="/models/other"), FakeVLLM(owned_by="sglang")
    try:
        with pytest.raises(ConfigError) as info:
            _engine(policy, [other, sglang_like])
        lines = info.value.problems
        assert len(lines) == 2
        assert other.url in lines[0] and "/models/other" in lines[0] and MODEL_PATH in lines[0]
        assert sglang_like.url in lines[1] and "not a vLLM server" in lines[1]
        assert other.calls == []  # nothing asked of it
    finally:
        other.kill()
        sglang_like.kill()


def test_a_url_nothing_listens_on_is_refused(policy):
    server = FakeVLLM()
    url = server.url
    server.kill()
    with pytest.raises(ConfigError, match=f"{url} is not a vLLM server that answers"):
        VLLMServerEngine(*policy, urls=[url], connect_timeout_s=2.0)


def test_a_push_pauses_updates_and_resumes_every_server(policy, servers):
    model, _ = policy
    engine = _engine(policy, servers)
    with torch.no_grad():
        model.model.norm.weight.add_(1.0)
    push_weights(engine, model, bucket_bytes=4096)  # several buckets: one update when the last one is in
    for server in servers:
        files = server.calls.count("/update_weights")  # a file per bucket, all between start and finish
        assert files > 1 and server.calls == ["/init_weight_transfer_engine", "/pause", "/start_weight_update",
                                              *["/update_weights"] * files, "/finish_weight_update",
                                              "/reset_prefix_cache", "/resume"]
        assert torch.equal(server.loaded["model.norm.weight"], model.model.norm.weight)
        assert set(server.loaded) == {n for n, _ in model.named_parameters()}
    engine.shutdown()


def test_the_next_push_rewrites_the_files_in_place_and_a_smaller_one_leaves_no_stale_file(policy, servers):
    """The second push of the same buckets writes over the first one's files (the same inodes: no page of a new
    file to allocate), and the servers load its weights; a push of fewer buckets removes the files it did not write
    (SGLang loads every file of the folder)."""
    model, _ = policy
    engine = _engine(policy, servers)
    push_weights(engine, model, bucket_bytes=4096)
    folder = engine._weight_root
    inodes = {name: os.stat(os.path.join(folder, name)).st_ino for name in os.listdir(folder)}
    assert len(inodes) > 1
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(-2.0)
    push_weights(engine, model, bucket_bytes=4096)
    assert {name: os.stat(os.path.join(folder, name)).st_ino for name in os.listdir(folder)} == inodes
    for server in servers:
        assert all(torch.equal(server.loaded[name], p) for name, p in model.named_parameters())
    push_weights(engine, model, bucket_bytes=1 << 30)  # one bucket: a new layout, written anew
    assert os.listdir(folder) == ["model-00001.safetensors"]
    for server in servers:
        assert all(torch.equal(server.loaded[name], p) for name, p in model.named_parameters())
    engine.shutdown()


def test_the_push_folder_goes_with_the_engine_without_a_shutdown(policy, servers):
    """Nothing in a fit calls `shutdown` on the engine: its folder of pushed files must not outlive it."""
    engine = _engine(policy, servers)
    push_weights(engine, policy[0], bucket_bytes=4096)
    folder = engine._weight_root
    assert os.path.isdir(folder)
    del engine
    gc.collect()
    assert not os.path.exists(folder)


def test_a_failed_update_still_resumes_the_server(policy, servers):
    model, _ = policy
    engine = _engine(policy, servers)
    servers[0].fail_route = "/update_weights"
    with pytest.raises(RuntimeError, match="HTTP 500"):
        push_weights(engine, model)
    assert servers[0].calls[-1] == "/resume" and "/finish_weight_update" not in servers[0].calls
    engine.shutdown()


@pytest.mark.parametrize("urls, match", [
    ([], "non-empty list"), ("http://127.0.0.1:1", "non-empty list"), (["127.0.0.1:8101"], "not a server URL"),
    (["http://127.0.0.1:8101/v1"], "without a path"), (["http://h:1", "http://h:1/"], "names a server twice")])
def test_url_problems(urls, match):
    (line,) = url_problems(urls)
    assert match in line
    assert url_problems(["http://127.0.0.1:8101", "https://gpu-node:8000"]) == []


def test_train_config_takes_server_engines_and_refuses_in_flight_pushes():
    from lit_rlvr.config.arguments import ModuleSettings
    from lit_rlvr.app.config_check import check_config
    from lit_rlvr.config.settings import (AlgorithmConfig, EngineConfig, EnvConfig, ModelConfig, PerfConfig,
                                          RewardConfig, RolloutConfig)
    from lit_rlvr.app.entry import compose_checked

    base = ["engine=vllm_server", "engine.options.urls=[http://127.0.0.1:8101,http://127.0.0.1:8102]"]
    check_config(compose_checked(None, base))
    with pytest.raises(ConfigError, match="engine.options.timeout_s"):
        check_config(compose_checked(None, [*base, "engine.options.timeout_s=abc"]))
    settings = ModuleSettings(ModelConfig(), AlgorithmConfig(), RewardConfig(),
                              EngineConfig("sglang_server", {"sync_check_every": 0}), EnvConfig(), PerfConfig(),
                              RolloutConfig(mode="async", partial_rollout=True, kv_at_swap="recompute"))
    assert any("rollout.partial_rollout=true with engine=sglang_server" in p for p in settings.problems())


def test_a_lora_policys_every_push_carries_every_weight_merged(servers):
    """No adapter routes: the servers get W + (α/r)·B A of each adapted layer, and every other weight, at every
    push (not the adapted layers alone after the first, as the in-process engines get)."""
    from lit_rlvr.config.settings import LoraOptions
    from lit_rlvr.models.lora import apply_lora, lora_delta, lora_factor_names, lora_layers
    from lit_rlvr.rollout.lora import hf_name
    from lit_rlvr.rollout.weight_sync import WeightSync

    model, tokenizer = build_tiny(0, hidden_size=32, heads=2)
    model.config._name_or_path = MODEL_PATH
    base_names = {name for name, _ in model.named_parameters()}
    policy = apply_lora(model, LoraOptions(rank=4))
    engine = VLLMServerEngine(policy, tokenizer, urls=[servers[0].url], connect_timeout_s=2.0)
    sync = WeightSync(engine, policy)
    for step in range(2):
        with torch.no_grad():
            for name, parameter in policy.named_parameters():
                if "lora_B" in name:
                    parameter.normal_(0.0, 0.1)
        sync.push(step=step)
        loaded = servers[0].loaded
        assert set(loaded) == base_names  # every weight, by its HF name, each push
        params = dict(policy.named_parameters())
        for layer_name, layer in lora_layers(policy):
            a, b = (params[name] for name in lora_factor_names(layer_name, layer))
            weight = params[f"{layer_name}.base_layer.weight"]
            expected = weight + lora_delta(layer, a, b)
            torch.testing.assert_close(loaded[hf_name(f"{layer_name}.base_layer.weight")], expected.detach())
    engine.shutdown()


def _push_from_rank(rank: int, init_file: str, urls: list[str], outcomes) -> None:
    """One of two gloo ranks: builds the engine over `urls` and pushes twice; puts (rank, [each push's error text or
    None])."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    found = []
    try:
        model, tokenizer = build_tiny(0, hidden_size=32, heads=2)
        model.config._name_or_path = MODEL_PATH
        engine = VLLMServerEngine(model, tokenizer, urls=urls, connect_timeout_s=2.0)
        for _ in range(2):
            try:
                push_weights(engine, model)
                found.append(None)
            except Exception as err:
                found.append(f"{type(err).__name__}: {err}")
        engine.shutdown()
    finally:
        outcomes.put((rank, found))
        dist.destroy_process_group()


def test_under_two_ranks_rank_0_alone_pushes_and_a_failure_stops_both(servers, tmp_path):
    """Two trainer ranks (gloo, spawned processes) over the same servers: each server takes one push per push
    (rank 0's), not one per rank; a push that fails on rank 0 raises on both ranks (rank 1 names rank 0's error)
    instead of leaving rank 1 sampling old weights."""
    import torch.multiprocessing as mp

    servers[0].fail_route, servers[0].fail_after = "/update_weights", 1  # the second push fails on one server
    context = mp.get_context("spawn")
    outcomes = context.Queue()
    urls = [s.url for s in servers]
    procs = [context.Process(target=_push_from_rank, args=(r, str(tmp_path / "rendezvous"), urls, outcomes))
             for r in (0, 1)]
    for proc in procs:
        proc.start()
    found = dict(outcomes.get(timeout=600) for _ in procs)
    for proc in procs:
        proc.join(timeout=60)
    assert found[0][0] is None and found[1][0] is None
    assert "HTTP 500" in found[0][1]
    assert found[1][1].startswith("EngineError: rank 0's weight push failed") and "HTTP 500" in found[1][1]
    assert servers[0].calls.count("/update_weights") == 2 and servers[1].calls.count("/update_weights") == 2
    names = {n for n, _ in build_tiny(0, hidden_size=32, heads=2)[0].named_parameters()}
    assert servers[0].calls[-1] == "/resume" and set(servers[1].loaded) == names
    assert servers[0].calls.count("/init_weight_transfer_engine") == 2  # each rank's engine checks the servers


# -- the HTTP rules of lit_rlvr/run/http.py (issue 61, class 2 and 3): the engines' client is that client ----------


def _redirect(to: str):
    def answer(handler: Handler) -> None:
        handler.send_response(307)
        handler.send_header("Location", to)
        handler.send_header("Content-Length", "0")
        handler.end_headers()
    return answer


def test_a_server_that_redirects_is_refused_and_the_other_host_never_asked(policy, servers):
    first, other = servers
    first.misbehave["/v1/models"] = _redirect(other.url + "/v1/models")  # at the start check
    with pytest.raises(ConfigError, match="answered HTTP 307, a redirect to .*follows no redirects") as info:
        _engine(policy, [first])
    assert other.url in str(info.value) and other.calls == []
    del first.misbehave["/v1/models"]
    engine = _engine(policy, [first])
    first.misbehave["/inference/v1/generate"] = _redirect(other.url + "/inference/v1/generate")  # mid-run
    with pytest.raises(HTTPRefusal, match="follows no redirects"):
        engine.generate([[5, 6]], [1], SamplingParams(max_new_tokens=4))
    assert other.generated == [] and engine.take_metrics()["engine/servers_alive"] == 1.0  # it answered: not gone
    engine.shutdown()


def test_an_answer_over_the_bound_is_refused_unread(policy, servers):
    sent = []

    def huge(handler: Handler) -> None:
        handler.send_response(200)
        handler.send_header("Transfer-Encoding", "chunked")  # no Content-Length to refuse it by
        handler.end_headers()
        try:
            for _ in range(64):  # 4 MiB in 64 KiB chunks
                handler.wfile.write(b"10000\r\n" + b" " * 65536 + b"\r\n")
                sent.append(65536)
            handler.wfile.write(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass

    engine = _engine(policy, servers[:1], max_response_bytes=1 << 18)
    servers[0].misbehave["/inference/v1/generate"] = huge
    with pytest.raises(HTTPRefusal, match=r"answered more than 262144 bytes \(engine.options.max_response_bytes"):
        engine.generate([[5, 6]], [1], SamplingParams(max_new_tokens=4))
    engine.shutdown()
    with pytest.raises(ConfigError, match="engine.options.max_response_bytes=0 is not valid"):
        _engine(policy, servers[:1], max_response_bytes=0)


def test_a_trickled_answer_ends_at_the_requests_deadline(policy, servers):
    def trickle(handler: Handler) -> None:
        handler.send_response(200)
        handler.send_header("Content-Length", "40")
        handler.end_headers()
        try:
            for _ in range(40):  # a byte every 0.25 s: each read is quick, the whole answer takes 10 s
                handler.wfile.write(b" ")
                handler.wfile.flush()
                time.sleep(0.25)
        except (BrokenPipeError, ConnectionResetError):
            pass

    engine = _engine(policy, servers[:1], timeout_s=1.0)
    servers[0].misbehave["/inference/v1/generate"] = trickle
    start = time.monotonic()
    with pytest.raises(EngineError, match="timed out, no whole answer within timeout_s=1s"):
        engine.generate([[5, 6]], [1], SamplingParams(max_new_tokens=4))
    assert time.monotonic() - start < 5.0  # the request's deadline, not a socket timeout per byte
    engine.shutdown()
