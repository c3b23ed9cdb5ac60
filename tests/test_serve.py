"""`lit-rlvr-serve` (lit_rlvr/app/serve.py): the engine server commands it builds (the servers themselves run in the
live tests), user flags over its defaults, and `--model` as a folder, a hub name or a refused path."""

from __future__ import annotations

import json

import pytest

from lit_rlvr.app.serve import model_folder, parse, preset_data, server_command
from lit_rlvr.config.errors import ConfigError


def _flags(argv: list[str]) -> dict[str, str]:
    out = {}
    for i, a in enumerate(argv):
        if a.startswith("--"):
            out[a] = argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("--") else ""
    return out


def test_vllm_command_has_what_a_run_needs(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"dtype": "float32"}))
    argv, env = server_command("vllm", str(tmp_path), host="127.0.0.1", port=8101, seed=0, cpu=True)
    flags = _flags(argv)
    assert flags["--model"] == str(tmp_path) and flags["--host"] == "127.0.0.1" and flags["--port"] == "8101"
    assert flags["--logprobs-mode"] == "processed_logprobs" and flags["--dtype"] == "float32"
    assert json.loads(flags["--weight-transfer-config"]) == {"backend": "lit_rlvr_file"}
    assert flags["--worker-extension-cls"] == "lit_rlvr.rollout.vllm_server_worker.ServerWorker"
    assert "--enable-scale-out" in flags and "--enforce-eager" in flags and env == {"VLLM_SERVER_DEV_MODE": "1"}


def test_sglang_command_and_user_flags_win(tmp_path):
    argv, env = server_command("sglang", str(tmp_path), host="0.0.0.0", port=9, seed=3, cpu=True,
                               extra=["--mem-fraction-static", "0.9", "--dtype=bfloat16"])
    flags = _flags(argv)
    assert flags["--model-path"] == str(tmp_path) and "--skip-tokenizer-init" in flags and flags["--host"] == "0.0.0.0"
    assert argv.count("--mem-fraction-static") == 1 and argv[argv.index("--mem-fraction-static") + 1] == "0.9"
    assert "--dtype" not in flags and "--dtype=bfloat16" in argv  # the user's, not the folder's (none here: auto)
    assert env == {"SGLANG_USE_CPU_ENGINE": "1"}
    gpu, env = server_command("sglang", str(tmp_path), host="127.0.0.1", port=9, seed=0, cpu=False)
    assert "--device" not in gpu and env == {}


def test_model_names(tmp_path):
    assert model_folder(str(tmp_path)) == str(tmp_path.resolve())
    assert model_folder("Qwen/Qwen3-4B-Instruct-2507") == "Qwen/Qwen3-4B-Instruct-2507"  # the engine fetches it
    with pytest.raises(ConfigError, match="no such folder"):
        model_folder("/no/such/model")
    assert preset_data("tiny_cot") == "arithmetic_cot" and preset_data("tiny") is None


def test_defaults_and_port_check():
    args, extra = parse(["--engine", "vllm", "--model", "tiny_cot", "--port", "8101", "--max-num-seqs", "8"])
    assert args.host == "127.0.0.1" and extra == ["--max-num-seqs", "8"]
    with pytest.raises(SystemExit):
        parse(["--engine", "vllm", "--model", "m", "--port", "70000"])
