"""Tenant isolation of checkpoints through the stock SDK: tenant B gets 404 for everything of tenant A's, until A
publishes a checkpoint; then B can read it (weights_info, load, download) but never change it."""

from __future__ import annotations

import httpx
import pytest
import tinker

from tests.conformance.rest_support import batch, rest, status_of, trained_client
from tests.support.server import ServerProcess


@pytest.fixture(scope="module")
def a_run(server: ServerProcess):  # type: ignore[no-untyped-def]
    sc = tinker.ServiceClient(base_url=server.base_url, api_key=server.api_key_a)
    tc = trained_client(sc, server.base_model, seed=7, user_metadata={"note": "for tenant A only"})
    state = tc.save_state("shared").result().path
    export = tc.save_weights_external("shared-export").result().path
    fwd = tc.forward(batch(7), "cross_entropy").result()
    yield tc, state, export, [o["logprobs"].tolist() for o in fwd.loss_fn_outputs]
    sc.close("success").result()


def test_other_tenant_sees_nothing(server: ServerProcess, a_run) -> None:  # type: ignore[no-untyped-def]
    tc, state, export, _ = a_run
    b = rest(server, "b")
    assert status_of(lambda: b.list_checkpoints(tc.model_id).result()) == 404
    assert status_of(lambda: b.get_training_run(tc.model_id).result()) == 404
    assert status_of(lambda: b.get_weights_info_by_tinker_path(state).result()) == 404
    assert status_of(lambda: b.get_external_weights_urls(export).result()) == 404
    assert status_of(lambda: b.publish_checkpoint_from_tinker_path(state).result()) == 404
    assert status_of(lambda: b.unpublish_checkpoint_from_tinker_path(state).result()) == 404
    assert status_of(lambda: b.set_checkpoint_ttl_from_tinker_path(state, 7200).result()) == 404
    assert status_of(lambda: b.delete_checkpoint_from_tinker_path(state).result()) == 404
    assert status_of(lambda: b.copy_weights(state, "proj-b").result()) == 404
    assert state not in {c.tinker_path for c in b.list_user_checkpoints(limit=1000).result().checkpoints}
    runs = b.list_training_runs(limit=1000, access_scope="accessible").result().training_runs
    assert tc.model_id not in {r.training_run_id for r in runs}
    with tinker.ServiceClient(base_url=server.base_url, api_key=server.api_key_b) as sc_b:
        assert status_of(lambda: sc_b.create_training_client_from_state(state).result()) == 404
    assert state in {c.tinker_path for c in rest(server).list_checkpoints(tc.model_id).result().checkpoints}


def test_published_checkpoint_is_readable_never_writable(server: ServerProcess, a_run) -> None:  # type: ignore[no-untyped-def]
    tc, state, export, a_logprobs = a_run
    a, b = rest(server), rest(server, "b")
    a.publish_checkpoint_from_tinker_path(state).result()
    a.publish_checkpoint_from_tinker_path(state).result()  # idempotent: a retried publish is not an error
    try:
        listed = {c.tinker_path: c for c in a.list_checkpoints(tc.model_id).result().checkpoints}
        assert listed[state].public and not listed[export].public
        assert b.get_weights_info_by_tinker_path(state).result().lora_rank == 4
        runs = b.list_training_runs(limit=1000, access_scope="accessible").result().training_runs
        assert tc.model_id in {r.training_run_id for r in runs}
        later = tc.save_state("later").result().path  # newer, not published: B must not see it
        seen_by_b = b.get_training_run(tc.model_id, access_scope="accessible").result()
        assert seen_by_b.training_run_id == tc.model_id and seen_by_b.last_checkpoint is not None
        assert seen_by_b.last_checkpoint.tinker_path == state and seen_by_b.user_metadata is None
        mine = a.get_training_run(tc.model_id).result()
        assert mine.last_checkpoint is not None and mine.last_checkpoint.tinker_path == later
        assert mine.user_metadata == {"note": "for tenant A only"}
        owned = b.list_training_runs(limit=1000).result().training_runs
        assert tc.model_id not in {r.training_run_id for r in owned}

        with tinker.ServiceClient(base_url=server.base_url, api_key=server.api_key_b) as sc_b:
            tb = sc_b.create_training_client_from_state(state).result()  # read-only use: B's own copy in memory
            got = [o["logprobs"].tolist() for o in tb.forward(batch(7), "cross_entropy").result().loss_fn_outputs]
            for x, y in zip(got, a_logprobs):
                assert x == pytest.approx(y, abs=1e-5)
            tb.forward_backward(batch(8), "cross_entropy").result()
            tb.optim_step(tinker.types.AdamParams(learning_rate=1e-2)).result()
            b_state = tb.save_state("mine").result().path
            assert b_state.startswith(f"tinker://{tb.model_id}/")

        for change in (lambda: b.delete_checkpoint_from_tinker_path(state).result(),
                       lambda: b.unpublish_checkpoint_from_tinker_path(state).result(),
                       lambda: b.set_checkpoint_ttl_from_tinker_path(state, 7200).result(),
                       lambda: b.list_checkpoints(tc.model_id).result()):
            assert status_of(change) == 404
        assert status_of(lambda: b.get_external_weights_urls(export).result()) == 404  # not published itself
        after = {c.tinker_path: c for c in a.list_checkpoints(tc.model_id).result().checkpoints}[state]
        assert after.public and after.expires_at is None and after.size_bytes == listed[state].size_bytes
    finally:
        a.unpublish_checkpoint_from_tinker_path(state).result()
    assert status_of(lambda: b.get_weights_info_by_tinker_path(state).result()) == 404


def test_signed_urls_are_bound_to_tenant_file_and_time(server: ServerProcess, a_run) -> None:  # type: ignore[no-untyped-def]
    tc, state, export, _ = a_run
    urls = rest(server).get_external_weights_urls(export).result().urls
    url = urls["adapter_config.json"]
    assert httpx.get(url).status_code == 200
    other_file = url.replace("/adapter_config.json?", "/adapter_model.safetensors?")
    assert httpx.get(other_file).status_code == 403  # the signature names one file
    later = url.replace("expires=", "expires=9")  # a longer life is not what was signed
    assert httpx.get(later).status_code == 403
    assert httpx.get(url.split("&sig=")[0] + "&sig=" + "A" * 43).status_code == 403
    assert httpx.get(url.replace("/adapter_config.json?", "/..%2F..%2Fserver-secret?")).status_code in (403, 404)
    assert status_of(lambda: rest(server, "b").get_external_weights_urls(export).result()) == 404
