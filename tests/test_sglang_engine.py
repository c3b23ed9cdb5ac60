"""SGLangEngine on CPU: request building, result parsing (fixtures from sglang 0.5.23's source) and the call
sequence against a fake `sglang` module; one real-engine test on a GPU with sglang installed."""

import atexit
import importlib.util
import inspect
import json
import os
import sys
import types
from pathlib import Path

import pytest
import torch

from lit_rlvr.rollout.engine import RolloutEngine, SamplingParams
from lit_rlvr.rollout.sglang import NEUTRAL_SAMPLING, build_requests, engine_args, parse_outputs
from lit_rlvr.rollout.weights import push_weights

FIXTURES = Path(__file__).parent / "fixtures" / "sglang_0_5_23"


def _fixture(name: str) -> dict:
    data = json.loads((FIXTURES / name).read_text())
    for out in data.get("outputs", []):  # in memory sglang hands out tuples; JSON stores lists
        out["meta_info"]["output_token_logprobs"] = [tuple(e) for e in out["meta_info"]["output_token_logprobs"]]
    return data


def _params(spec: dict) -> SamplingParams:
    return SamplingParams(**{**spec, "stop_token_ids": tuple(spec["stop_token_ids"])})


# -- request building --------------------------------------------------------------------------------------------
def test_requests_expand_n_per_prompt_in_order_with_distinct_seeds():
    prompts, n = [[5, 6, 7], [8, 9], [10, 11, 12, 13]], [2, 0, 3]
    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=5, max_new_tokens=6, stop_token_ids=(14, 2), seed=3)
    input_ids, sampling = build_requests(prompts, n, params, eos_id=2)
    assert input_ids == [[5, 6, 7]] * 2 + [[10, 11, 12, 13]] * 3
    assert len(sampling) == 5
    assert len({s["sampling_seed"] for s in sampling}) == 5  # sglang's seeded sampler hashes (seed, position)
    assert sampling == build_requests(prompts, n, params, eos_id=2)[1]  # a function of params.seed only
    other = build_requests(prompts, n, SamplingParams(seed=4), eos_id=2)[1]
    assert {s["sampling_seed"] for s in other}.isdisjoint({s["sampling_seed"] for s in sampling})
    for s in sampling:
        assert s["stop_token_ids"] == [2, 14]  # eos added once, sorted
        assert (s["temperature"], s["top_p"], s["top_k"], s["max_new_tokens"]) == (0.7, 0.9, 5, 6)
        assert 0 <= s["sampling_seed"] < 1 << 63  # sglang's verify(): int64
        assert {k: s[k] for k in NEUTRAL_SAMPLING} == NEUTRAL_SAMPLING


def test_requests_greedy_and_top_k_off():
    _, (greedy,) = build_requests([[1, 2]], [1], SamplingParams(temperature=0.0, top_k=0), eos_id=None)
    assert greedy["temperature"] == 0.0  # sglang: 0 <= T < 1e-6 -> top_k = 1 at T = 1 (HFEngine's convention)
    assert greedy["top_k"] == -1  # sglang's "whole vocabulary"; 0 fails its verify()
    assert greedy["stop_token_ids"] == []


def test_requests_ignore_eos_stops_on_nothing():
    _, (plain,) = build_requests([[1, 2]], [1], SamplingParams(stop_token_ids=(14,)), eos_id=2)
    _, (ignore,) = build_requests([[1, 2]], [1], SamplingParams(stop_token_ids=(14,), ignore_eos=True), eos_id=2)
    assert (plain["stop_token_ids"], plain["ignore_eos"]) == ([2, 14], False)
    assert (ignore["stop_token_ids"], ignore["ignore_eos"]) == ([], True)  # sglang skips stop ids then, so HF does


def test_requests_zero_samples_and_empty_prompt():
    assert build_requests([[1], [2]], [0, 0], SamplingParams(), eos_id=2) == ([], [])
    assert build_requests([[], [2]], [0, 1], SamplingParams(), eos_id=2)[0] == [[2]]  # unused empty prompt is fine
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        build_requests([[], [2]], [1, 1], SamplingParams(), eos_id=2)
    with pytest.raises(ValueError, match="2 prompts but 1"):
        build_requests([[1], [2]], [1], SamplingParams(), eos_id=2)


# -- result parsing ----------------------------------------------------------------------------------------------
def test_parse_fixture_tokens_logprobs_reasons_and_order():
    data = _fixture("generate_batch.json")
    req = data["request"]
    input_ids, _ = build_requests(req["prompt_token_ids"], req["n_per_prompt"], _params(req["params"]), req["eos_id"])
    assert len(input_ids) == len(data["outputs"])
    groups = parse_outputs(data["outputs"], req["n_per_prompt"])
    assert [len(g) for g in groups] == [2, 0, 1]
    first, second = groups[0]
    assert first.token_ids.dtype == torch.long and first.logprobs.dtype == torch.float32
    assert first.token_ids.tolist() == [20, 21, 2] and first.finish_reason == "stop"  # eos kept
    assert torch.equal(first.logprobs, torch.tensor([-0.3125, -1.1875, -0.046875]))
    assert second.token_ids.tolist() == [22, 23, 24, 25] and second.finish_reason == "length"
    (third,) = groups[2]
    assert third.token_ids.tolist() == [30, 14] and third.finish_reason == "stop"  # a stop_token_ids entry
    for group in groups:
        for c in group:
            assert c.token_ids.shape == c.logprobs.shape


def test_parse_rejects_abort_count_mismatch_and_misaligned_logprobs():
    with pytest.raises(RuntimeError, match="abort"):
        parse_outputs(_fixture("generate_abort.json")["outputs"], [1])
    outputs = _fixture("generate_batch.json")["outputs"]
    with pytest.raises(RuntimeError, match="3 outputs for 2 requests"):
        parse_outputs(outputs, [2])
    outputs[0]["meta_info"]["output_token_logprobs"] = outputs[0]["meta_info"]["output_token_logprobs"][:-1]
    with pytest.raises(RuntimeError, match="do not match"):
        parse_outputs(outputs, [2, 0, 1])


# -- push_weights --------------------------------------------------------------------------------------------
def test_push_weights_ends_the_update_once_when_the_engine_can():
    class Recorder(RolloutEngine):  # the base class's end_weight_update does nothing
        def __init__(self):
            self.calls = []

        def load_weights(self, bucket):
            self.calls.append([name for name, _ in bucket])

    class Ending(Recorder):
        def end_weight_update(self):
            self.calls.append("end")

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    plain, ending = Recorder(), Ending()
    push_weights(plain, model, bucket_bytes=64)
    push_weights(ending, model, bucket_bytes=64)
    assert len(plain.calls) > 1 and "end" not in plain.calls  # engines without the hook are unchanged
    assert ending.calls == [*plain.calls, "end"]


# -- the engine against a fake sglang ----------------------------------------------------------------------------
API = json.loads((FIXTURES / "engine_api.json").read_text())["methods"]
FIELDS = json.loads((FIXTURES / "server_args_fields.json").read_text())


class FakeEngine:
    """Records calls; signatures as in sglang 0.5.23 (checked against engine_api.json below)."""

    def __init__(self, **kwargs):
        unknown = set(kwargs) - set(FIELDS["fields"])
        assert not unknown, f"not ServerArgs fields (or not in server_args_fields.json): {unknown}"
        assert kwargs["load_format"] in FIELDS["choices"]["load_format"]
        assert kwargs["dtype"] in FIELDS["choices"]["dtype"]
        self.kwargs, self.calls, self.loaded = kwargs, [], []
        self.module = sys.modules["sglang.srt.entrypoints.engine"]
        self.module.instances.append(self)
        atexit.register(self.shutdown)  # as Engine.__init__ does

    def generate(self, prompt=None, sampling_params=None, input_ids=None, image_data=None, audio_data=None,
                 video_data=None, mm_hashes=None, mm_content_hashes=None, return_logprob=False):
        self.calls.append("generate")
        assert prompt is None and return_logprob is True
        eos = 2  # the tiny tokenizer's
        return [{"output_ids": [row[-1] + 1, eos],
                 "meta_info": {"id": f"r{i}", "finish_reason": {"type": "stop", "matched": eos},
                               "output_token_logprobs": [(-0.5, row[-1] + 1, None), (-0.25, eos, None)]}}
                for i, row in enumerate(input_ids)]

    def begin_weight_update(self, selector="all"):
        self.calls.append("begin")
        return True, "Success"

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        self.calls.append(("update", flush_cache, load_format))
        self.loaded.extend(name for name, _ in named_tensors)
        return True, "Success"

    def end_weight_update(self):
        self.calls.append("end")
        return True, "Success"

    def flush_cache(self):
        self.calls.append("flush")
        return types.SimpleNamespace(success=True, message="")

    def release_memory_occupation(self, tags=None):
        self.calls.append(("release", tags))

    def resume_memory_occupation(self, tags=None):
        self.calls.append(("resume", tags))

    def get_all_child_pids(self):
        return [4242, 4343]

    def shutdown(self):
        self.calls.append("shutdown")
        self.module.kill_process_tree(os.getpid(), include_parent=False, wait_timeout=60)


@pytest.fixture
def fake_sglang(monkeypatch):
    killed = []
    engine_module = types.ModuleType("sglang.srt.entrypoints.engine")
    engine_module.Engine, engine_module.instances = FakeEngine, []
    engine_module.kill_process_tree = lambda pid, include_parent=True, skip_pid=None, wait_timeout=60: killed.append(
        (pid, include_parent))
    for name in ("sglang", "sglang.srt", "sglang.srt.entrypoints"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "sglang.srt.entrypoints.engine", engine_module)
    monkeypatch.delenv("SGLANG_RETURN_ORIGINAL_LOGPROB", raising=False)
    engine_module.killed = killed
    return engine_module


def _tiny():
    from lit_rlvr.models.tiny import build_tiny

    return build_tiny(seed=0, hidden_size=16, layers=1, heads=2)


def _engine(**options):
    from lit_rlvr.rollout.sglang import SGLangEngine

    model, tokenizer = _tiny()
    return SGLangEngine(model, tokenizer, **options), model


def test_fake_engine_matches_sglang_signatures():
    for name, spec in API.items():
        params = [p for p in inspect.signature(getattr(FakeEngine, name)).parameters if p != "self"]
        assert params[: len(spec["params"])] == spec["params"], name


def test_missing_sglang_says_how_to_install(monkeypatch):
    from lit_rlvr.rollout import build_engine

    monkeypatch.setitem(sys.modules, "sglang", None)  # import sglang -> ImportError
    model, tokenizer = _tiny()
    with pytest.raises(ImportError, match=r'pip install -e "\.\[sglang\]"'):
        build_engine("sglang", model, tokenizer)


def test_engine_arguments_and_per_rank_ports_seeds_gpus(fake_sglang, monkeypatch):
    engine, model = _engine(seed=7, mem_fraction_static=0.4)
    rank0 = fake_sglang.instances[-1].kwargs
    assert rank0["skip_tokenizer_init"] is True and rank0["load_format"] == "dummy"
    assert rank0["enable_memory_saver"] is True and rank0["dtype"] == "float32"
    assert (rank0["base_gpu_id"], rank0["random_seed"], rank0["mem_fraction_static"]) == (0, 7, 0.4)
    config = json.loads((Path(rank0["model_path"]) / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"]  # sglang picks its model class from it
    assert not engine.shares_weights and not engine.holds_weights and engine.bucket_bytes == 256 << 20
    engine.shutdown()
    assert not Path(rank0["model_path"]).exists()

    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 1)
    monkeypatch.setenv("LOCAL_RANK", "1")
    _engine(seed=7, server_args={"attention_backend": "triton"})[0].shutdown()
    rank1 = fake_sglang.instances[-1].kwargs
    assert (rank1["base_gpu_id"], rank1["random_seed"]) == (1, 8)
    assert rank1["attention_backend"] == "triton"
    assert engine_args("m", torch.float32, rank=1, local_rank=1, base_port=0, port_stride=10, seed=0,
                       mem_fraction_static=0.1, deterministic=False,
                       server_args={"device": "cpu"})["base_gpu_id"] == 0  # sglang's CPU mode: a NUMA node
    ports0, ports1 = {rank0["port"], rank0["nccl_port"]}, {rank1["port"], rank1["nccl_port"]}
    assert len(ports0) == len(ports1) == 2 and ports0.isdisjoint(ports1)


def test_weight_push_flushes_once_after_last_bucket(fake_sglang):
    engine, model = _engine()
    fake = fake_sglang.instances[-1]
    with pytest.raises(RuntimeError, match="holds no weights"):  # dummy weights until the first push
        engine.generate([[5, 6]], [1], SamplingParams())
    fake.calls.clear()
    push_weights(engine, model, bucket_bytes=4096)  # several buckets
    updates = [c for c in fake.calls if c[0] == "update"]
    assert len(updates) > 2
    assert fake.calls == ["begin", *updates, "end", "flush"]  # one session, one flush after the last bucket
    assert all(flush is False and load_format is None for _, flush, load_format in updates)
    assert fake.loaded == [name for name, _ in model.named_parameters()]  # HF names, unchanged
    assert engine.holds_weights
    out = engine.generate([[5, 6], [7]], [2, 1], SamplingParams(temperature=0.0))
    assert [[c.token_ids.tolist() for c in g] for g in out] == [[[7, 2], [7, 2]], [[8, 2]]]
    assert out[0][0].finish_reason == "stop" and out[0][0].logprobs.tolist() == [-0.5, -0.25]
    assert engine.generate([[5, 6]], [0], SamplingParams()) == [[]]  # no sglang call for an empty batch
    assert fake.calls.count("generate") == 1
    engine.shutdown()


def test_generate_closes_an_update_left_open(fake_sglang):
    engine, model = _engine()
    fake = fake_sglang.instances[-1]
    engine.load_weights(list(model.named_parameters()))
    engine.generate([[5]], [1], SamplingParams())
    assert fake.calls[-4:] == [("update", False, None), "end", "flush", "generate"]
    engine.shutdown()


def test_sleep_wake_are_idempotent_and_drop_the_weights(fake_sglang):
    engine, model = _engine()
    fake = fake_sglang.instances[-1]
    push_weights(engine, model)
    fake.calls.clear()
    engine.sleep()
    engine.sleep()
    assert fake.calls == [("release", None)] and not engine.holds_weights  # the trainer pushes again
    engine.wake()
    engine.wake()
    assert fake.calls == [("release", None), ("resume", None)]
    with pytest.raises(RuntimeError, match="holds no weights"):
        engine.generate([[5]], [1], SamplingParams())
    engine.sleep()
    push_weights(engine, model)  # a push wakes the engine first
    assert fake.calls[2:4] == [("release", None), ("resume", None)] and fake.calls[4] == "begin"
    assert engine.generate([[5]], [1], SamplingParams())[0][0].finish_reason == "stop"
    engine.shutdown()


def test_shutdown_kills_only_its_own_processes(fake_sglang):
    engine, _ = _engine()
    fake = fake_sglang.instances[-1]
    engine.shutdown()
    engine.shutdown()  # idempotent
    engine.sleep()  # no-ops after shutdown
    engine.wake()
    assert fake.calls.count("shutdown") == 1
    assert fake_sglang.killed == [(4242, True), (4343, True)]  # never (os.getpid(), include_parent=False)
    assert fake_sglang.kill_process_tree.__name__ == "<lambda>"  # the module's function is restored


def test_bad_options_are_refused(fake_sglang, monkeypatch):
    with pytest.raises(ValueError, match="engine.options.dtype"):
        _engine(dtype="float8")
    monkeypatch.setenv("SGLANG_RETURN_ORIGINAL_LOGPROB", "1")  # sglang would return log-probs before 1/T
    with pytest.raises(ValueError, match="temperature"):
        _engine()


def test_shipped_config_options_are_engine_arguments():
    from omegaconf import OmegaConf

    from lit_rlvr.rollout.sglang import SGLangEngine

    cfg = OmegaConf.load(Path(__file__).parents[1] / "conf" / "engine" / "sglang.yaml")
    assert cfg.name == "sglang"
    params = inspect.signature(SGLangEngine.__init__).parameters
    from lit_rlvr.rollout.lora import SyncCheck

    options = dict(cfg.options)
    SyncCheck.take_from(options)  # the driver's post-push check: the rest is the engine's
    assert set(options) <= set(params) - {"self", "model", "tokenizer"}
    for key, value in options.items():
        assert value == params[key].default or key == "server_args", key  # one set of defaults


# -- the real engine -------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("sglang") is None,
                    reason="needs CUDA and sglang (pip install -e '.[sglang]')")
def test_real_sglang_greedy_equals_hf_engine(tiny_path):
    from lit_rlvr.models import load_policy
    from lit_rlvr.rollout.hf import HFEngine
    from lit_rlvr.rollout.sglang import SGLangEngine

    model, tokenizer = load_policy(tiny_path)
    model = model.cuda().eval()
    prompts = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in ["12+34=", "5+5=", "71-18=", "3*4="]]
    params = SamplingParams(temperature=0.0, max_new_tokens=12)
    engine = SGLangEngine(model, tokenizer, mem_fraction_static=0.2,
                          server_args={"attention_backend": "torch_native", "disable_cuda_graph": True})
    try:
        push_weights(engine, model)
        got = engine.generate(prompts, [2, 1, 1, 1], params)
        engine.sleep()
        engine.wake()
        push_weights(engine, model)
        again = engine.generate(prompts, [1, 1, 1, 1], params)
    finally:
        engine.shutdown()
    want = HFEngine(model, pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id).generate(prompts, [2, 1, 1, 1],
                                                                                                  params)
    for got_group, want_group in zip(got, want):
        for g, w in zip(got_group, want_group):
            assert g.token_ids.tolist() == w.token_ids.tolist() and g.finish_reason == w.finish_reason
            assert torch.allclose(g.logprobs, w.logprobs, atol=1e-3)
    assert [g[0].token_ids.tolist() for g in again] == [g[0].token_ids.tolist() for g in want]


def test_lora_server_args_serve_the_policys_adapters():
    """A LoRA policy with lora_sync=adapter starts sglang with its rank, the short names of the layers it adapts
    and the adapters a batch may mix; on a CPU with the pure-torch LoRA kernels (sglang's default are Triton's)."""
    from lit_rlvr.config.settings import LoraOptions
    from lit_rlvr.models.lora import apply_lora
    from lit_rlvr.models.tiny import build_tiny
    from lit_rlvr.rollout.sglang import lora_server_args

    policy = apply_lora(build_tiny(seed=0)[0], LoraOptions(rank=4, target_modules=("q_proj", "v_proj")))
    args = lora_server_args(policy, max_loras=5)
    assert args == {"enable_lora": True, "max_lora_rank": 4, "lora_target_modules": ["q_proj", "v_proj"],
                    "max_loras_per_batch": 5}
    assert lora_server_args(policy, max_loras=5, cpu=True)["lora_backend"] == "torch_native"
    every = lora_server_args(apply_lora(build_tiny(seed=0)[0], LoraOptions(rank=2)), max_loras=8)
    assert every["lora_target_modules"] == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj",
                                            "v_proj"]
