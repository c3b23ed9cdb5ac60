"""`engine=sglang_server` against two real SGLang servers started with `lit-rlvr-serve --engine sglang --model
tiny_cot` on 127.0.0.1 (in the venv of scripts/sglang_cpu_env.sh; .ci/run's SGLang stage): a GRPO run over both whose
every push (`/update_weights_from_disk`) passes the post-push check (`engine/sync_logp_diff`), a server of another
model refused before any work, a server killed mid-run (the run goes on over the other), and every server gone (the
run stops naming the URL and its last checkpoint)."""

from __future__ import annotations

import pytest
from sglang_live import live

from tests.server_live import (check_async, check_c3po, check_lora, check_two_nodes, rows, start_servers, train,
                               urls, wait_rows)

pytestmark = live

ENGINE = ["engine=sglang_server"]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    made = start_servers("sglang", "tiny_cot", tmp_path_factory.mktemp("sglang_servers"), 2)
    yield made
    for server in made:
        server.kill()


def test_grpo_over_two_servers_pushes_every_step(servers, tmp_path):
    code, out = train(tmp_path / "run", [*ENGINE, urls(servers)], steps=3)
    assert code == 0, out[-5000:]
    logged = rows(tmp_path / "run")
    assert len(logged) == 3
    for row in logged:
        assert row["engine/sync_logp_diff"] <= 0.02  # each push reached the servers: their log-probs are the trainer's
        assert row["engine/servers_alive"] == 2 and row["engine/requests_retried"] == 0
    # the weights moved before a later push (checked in the next step's row); a step whose groups all score the
    # same has no gradient
    assert any(row["grad/norm"] > 0 for row in logged[:-1])
    assert (tmp_path / "run" / "checkpoints" / "last.ckpt").exists()


def test_a_server_of_another_model_is_refused_before_any_work(servers):
    from lit_rlvr.config.errors import ConfigError
    from lit_rlvr.models.tiny import build_tiny
    from lit_rlvr.rollout.sglang_server import SGLangServerEngine

    model, tokenizer = build_tiny(0, hidden_size=64, heads=2)
    model.config._name_or_path = "/models/elsewhere"
    with pytest.raises(ConfigError) as info:
        SGLangServerEngine(model, tokenizer, urls=[servers[0].url])
    (line,) = info.value.problems
    assert servers[0].url in line and "/models/elsewhere" in line and "tiny-" in line


def test_c3po_over_two_servers(servers, tmp_path):
    check_c3po("sglang", servers, tmp_path / "run")


def test_a_lora_policy_with_c3po_over_two_servers(servers, tmp_path):
    check_lora("sglang", servers, tmp_path / "run")


def test_async_s1_over_two_servers_pushes_in_flight(servers, tmp_path):
    check_async("sglang", servers, tmp_path / "run")


def test_two_trainer_nodes_over_two_servers(servers, tmp_path):
    check_two_nodes("sglang", servers, tmp_path / "run")


def test_a_server_killed_mid_run_the_other_takes_its_requests(servers, tmp_path):
    run = tmp_path / "run"
    proc = train(run, [*ENGINE, urls(servers)], steps=3, background=True)
    wait_rows(run, 1, proc)
    servers[1].kill()
    out, _ = proc.communicate(timeout=1800)
    assert proc.returncode == 0, out[-5000:]
    logged = rows(run)
    assert len(logged) == 3 and logged[-1]["engine/servers_alive"] == 1
    assert all(r["engine/sync_logp_diff"] <= 0.02 for r in logged)


def test_every_server_gone_stops_the_run_naming_them_and_the_checkpoint(servers, tmp_path):
    run = tmp_path / "run"
    alive = [s for s in servers if s.alive()]
    proc = train(run, [*ENGINE, urls(alive)], steps=6, background=True)
    wait_rows(run, 1, proc)
    for server in alive:
        server.kill()
    out, _ = proc.communicate(timeout=1800)
    assert proc.returncode != 0
    assert "every rollout server is gone" in out and all(s.url in out for s in alive), out[-3000:]
    assert "last.ckpt" in out and (run / "checkpoints" / "last.ckpt").exists()
