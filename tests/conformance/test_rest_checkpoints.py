"""RestClient against the server with the stock SDK: training runs (list with cursor, get), checkpoints (per run,
per tenant, TTL at save and later, delete of files and row), weights_info, copy_weights, storage usage."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
import tinker

from tests.conformance.rest_support import batch, rest, status_of, trained_client
from tests.support.server import ServerProcess


@pytest.fixture(scope="module")
def run(server: ServerProcess):  # type: ignore[no-untyped-def]
    """One training run of tenant A with a training checkpoint (TTL 2 h) and a sampler checkpoint."""
    sc = tinker.ServiceClient(base_url=server.base_url, api_key=server.api_key_a, project_id="proj-rest")
    tc = trained_client(sc, server.base_model)
    state = tc.save_state("s1", ttl_seconds=7200).result().path
    sampler = tc.save_weights_for_sampler("w1").result().path
    yield sc, tc, state, sampler
    sc.close("success").result()


def test_list_checkpoints_of_run(server: ServerProcess, run) -> None:  # type: ignore[no-untyped-def]
    sc, tc, state, sampler = run
    rc = rest(server)
    listed = {c.tinker_path: c for c in rc.list_checkpoints(tc.model_id).result().checkpoints}
    assert set(listed) >= {state, sampler}
    s1, w1 = listed[state], listed[sampler]
    assert (s1.checkpoint_type, s1.checkpoint_id) == ("training", "weights/s1")
    assert (w1.checkpoint_type, w1.checkpoint_id) == ("sampler", "sampler_weights/w1")
    assert s1.size_bytes and w1.size_bytes and s1.size_bytes > w1.size_bytes  # optimizer state is in s1 only
    assert s1.expires_at is not None and w1.expires_at is None
    left = s1.expires_at - datetime.now(timezone.utc)
    assert timedelta(hours=1, minutes=50) < left <= timedelta(hours=2)
    assert not s1.public


def test_user_checkpoints_newest_first_with_cursor(server: ServerProcess, run) -> None:  # type: ignore[no-untyped-def]
    sc, tc, state, sampler = run
    rc = rest(server)
    first = rc.list_user_checkpoints(limit=1, offset=0).result()
    assert first.cursor is not None and first.cursor.total_count >= 2 and first.cursor.limit == 1
    second = rc.list_user_checkpoints(limit=1, offset=1).result()
    assert len(first.checkpoints) == len(second.checkpoints) == 1
    assert first.checkpoints[0].time >= second.checkpoints[0].time
    everything = rc.list_user_checkpoints(limit=100).result().checkpoints
    assert {state, sampler} <= {c.tinker_path for c in everything}


def test_training_runs(server: ServerProcess, run) -> None:  # type: ignore[no-untyped-def]
    sc, tc, state, sampler = run
    rc = rest(server)
    got = rc.get_training_run(tc.model_id).result()
    assert got.training_run_id == tc.model_id and got.base_model == server.base_model and got.lora_rank == 4
    assert got.is_lora and got.last_checkpoint is not None and got.last_checkpoint.tinker_path == state
    assert got.last_sampler_checkpoint is not None and got.last_sampler_checkpoint.tinker_path == sampler
    assert rc.get_training_run_by_tinker_path(state).result().training_run_id == tc.model_id
    trained_client(sc, server.base_model, steps=0)  # a second run, so paging has two pages
    page1 = rc.list_training_runs(limit=1, offset=0).result()
    page2 = rc.list_training_runs(limit=1, offset=1).result()
    assert page1.cursor.total_count >= 2 and page1.cursor.offset == 0 and page2.cursor.offset == 1
    assert page1.training_runs[0].training_run_id != page2.training_runs[0].training_run_id
    in_project = rc.list_training_runs(limit=100, project_id="proj-rest").result().training_runs
    assert tc.model_id in {r.training_run_id for r in in_project}
    assert rc.list_training_runs(limit=100, project_id="no-such-project").result().training_runs == []


def test_weights_info(server: ServerProcess, run) -> None:  # type: ignore[no-untyped-def]
    sc, tc, state, sampler = run
    info = rest(server).get_weights_info_by_tinker_path(state).result()
    assert info.base_model == server.base_model and info.is_lora and info.lora_rank == 4
    assert info.train_attn and info.train_mlp and info.train_unembed


def test_ttl_later_and_delete(server: ServerProcess, run) -> None:  # type: ignore[no-untyped-def]
    sc, tc, state, sampler = run
    rc = rest(server)
    path = tc.save_weights_for_sampler("ttl-me").result().path

    def expires() -> datetime | None:
        return next(c for c in rc.list_checkpoints(tc.model_id).result().checkpoints if c.tinker_path == path).expires_at

    assert expires() is None
    rc.set_checkpoint_ttl_from_tinker_path(path, 5 * 3600).result()
    exp = expires()
    assert exp is not None and timedelta(hours=4, minutes=59) < exp - datetime.now(timezone.utc) <= timedelta(hours=5)
    rc.set_checkpoint_ttl_from_tinker_path(path, None).result()
    assert expires() is None
    assert status_of(lambda: rc.set_checkpoint_ttl_from_tinker_path(path, 10).result()) == 400
    assert status_of(lambda: tc.save_state("short", ttl_seconds=5).result()) == 400

    run_id, kind, name = path.removeprefix("tinker://").split("/")
    folders = list(server.data_dir.glob(f"checkpoints/*/{run_id}/{kind}/{name}"))
    assert len(folders) == 1 and any(folders[0].iterdir())
    rc.delete_checkpoint_from_tinker_path(path).result()
    assert path not in {c.tinker_path for c in rc.list_checkpoints(tc.model_id).result().checkpoints}
    assert path not in {c.tinker_path for c in rc.list_user_checkpoints(limit=1000).result().checkpoints}
    assert not folders[0].exists()
    assert status_of(lambda: rc.delete_checkpoint_from_tinker_path(path).result()) == 404
    assert status_of(lambda: sc.create_training_client_from_state(path).result()) == 404


def test_copy_weights(server: ServerProcess, run) -> None:  # type: ignore[no-untyped-def]
    sc, tc, state, sampler = run
    rc = rest(server)
    source = tc.save_state("to-copy").result().path
    fwd = tc.forward(batch(3), "cross_entropy").result()
    copy = rc.copy_weights(source, "proj-archive", ttl_seconds=3 * 3600).result()
    assert copy != source and copy.endswith("/weights/to-copy")
    copy_run = copy.removeprefix("tinker://").split("/")[0]
    listed = rc.list_checkpoints(copy_run).result().checkpoints
    assert [c.tinker_path for c in listed] == [copy] and listed[0].expires_at is not None
    archived = rc.list_training_runs(limit=100, project_id="proj-archive").result().training_runs
    assert copy_run in {r.training_run_id for r in archived}
    rc.delete_checkpoint_from_tinker_path(source).result()  # the copy keeps its own files
    resumed = sc.create_training_client_from_state(copy).result()
    again = resumed.forward(batch(3), "cross_entropy").result()
    for a, b in zip(fwd.loss_fn_outputs, again.loss_fn_outputs):
        assert a["logprobs"].tolist() == pytest.approx(b["logprobs"].tolist(), abs=1e-5)
    rc.delete_checkpoint(copy_run, "weights/to-copy").result()  # the (run id, checkpoint id) form
    assert rc.list_checkpoints(copy_run).result().checkpoints == []


def test_storage_usage(server: ServerProcess, run) -> None:  # type: ignore[no-untyped-def]
    sc, tc, state, sampler = run
    caps = rest(server).get_server_capabilities().result()
    assert server.base_model in {m.model_name for m in caps.supported_models}
    admin = tinker.AdminClient(base_url=server.base_url, api_key=server.api_key_a)
    usage = admin.get_current_checkpoint_storage_usage().result().data
    listed = rest(server).list_user_checkpoints(limit=1000).result().checkpoints
    assert len(usage) == 1 and usage[0].checkpoint_count == len(listed)
    assert usage[0].size_bytes == sum(c.size_bytes or 0 for c in listed) > 0
