"""Sessions through the stock SDK's RestClient: list, get, search (filters, statuses, cursor), project moves, and
tenant isolation (another tenant's session answers 404 and never shows up in a search)."""

from __future__ import annotations

import warnings

import pytest
import tinker
from tinker import types

from tests.conformance.rest_support import rest, session_of, status_of, trained_client
from tests.support.server import ServerProcess


def search(rc: tinker.RestClient, **kw) -> types.SessionSearchResponse:  # type: ignore[no-untyped-def]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # search_sessions is marked experimental
        return rc.search_sessions(types.SessionSearchRequest(**kw)).result()


@pytest.fixture(scope="module")
def sessions(server: ServerProcess):  # type: ignore[no-untyped-def]
    """Two finished sessions of tenant A (one with a run and a checkpoint) and one still open."""
    ids = []
    with tinker.ServiceClient({"team": "red", "exp": "1"}, "proj-s", display_name="Nightly sweep alpha",
                              base_url=server.base_url, api_key=server.api_key_a) as sc:
        tc = trained_client(sc, server.base_model, steps=0)
        tc.save_weights_for_sampler("s-ckpt").result()
        ids.append(session_of(tc.model_id))
        run_id = tc.model_id
    sc2 = tinker.ServiceClient({"team": "blue"}, "proj-t", display_name="debug beta",
                               base_url=server.base_url, api_key=server.api_key_a)
    ids.append(session_of(trained_client(sc2, server.base_model, steps=0).model_id))
    sc2.close("interrupted").result()
    sc3 = tinker.ServiceClient({"team": "red"}, display_name="live gamma", base_url=server.base_url,
                               api_key=server.api_key_a)
    ids.append(session_of(trained_client(sc3, server.base_model, steps=0).model_id))
    yield ids, run_id
    sc3.close("success").result()


def test_list_and_get(server: ServerProcess, sessions) -> None:  # type: ignore[no-untyped-def]
    ids, run_id = sessions
    rc = rest(server)
    newest = rc.list_sessions(limit=3).result().sessions
    assert newest == list(reversed(ids))  # newest first
    assert rc.list_sessions(limit=2, offset=1).result().sessions == [ids[1], ids[0]]
    got = rc.get_session(ids[0]).result()
    assert got.training_run_ids == [run_id] and got.display_name == "Nightly sweep alpha"
    assert got.user_metadata == {"team": "red", "exp": "1"} and got.sampler_ids == []
    assert status_of(lambda: rest(server, "b").get_session(ids[0]).result()) == 404
    assert not set(ids) & set(rest(server, "b").list_sessions(limit=1000).result().sessions)


def test_search_filters(server: ServerProcess, sessions) -> None:  # type: ignore[no-untyped-def]
    ids, _ = sessions
    rc = rest(server)
    found = search(rc, display_name="sweep NIGHTLY")  # every word, any case
    assert [s.session_id for s in found.sessions] == [ids[0]]
    first = found.sessions[0]
    assert first.project_id == "proj-s" and first.checkpoints_count == 1 and first.checkpoint_storage_bytes
    assert first.status is not None and first.status.type == "client_finished"
    assert first.status.reason.type == "success"
    assert [s.session_id for s in search(rc, user_metadata={"team": "red"}, limit=200).sessions
            if s.session_id in ids] == [ids[2], ids[0]]
    assert [s.session_id for s in search(rc, project_ids=["proj-t"]).sessions] == [ids[1]]
    either = search(rc, session_id=ids[1], display_name="gamma")
    assert [s.session_id for s in either.sessions] == [ids[2], ids[1]]
    active = [s.session_id for s in search(rc, statuses=[types.ActiveSessionStatusQuery()], limit=200).sessions]
    assert ids[2] in active and ids[0] not in active and ids[1] not in active
    interrupted = search(rc, statuses=[types.ClientFinishedSessionStatusQuery(reasons=["interrupted"])], limit=200)
    assert [s.session_id for s in interrupted.sessions if s.session_id in ids] == [ids[1]]
    assert search(rc, statuses=[types.FailedSessionStatusQuery()]).sessions == []
    assert not {s.session_id for s in search(rest(server, "b"), limit=200).sessions} & set(ids)
    other = types.UserSearchOwner(owner_urns=["twinkle:tenant:someone-else"])
    assert search(rc, owner=other).sessions == []


def test_search_pages_with_a_cursor(server: ServerProcess, sessions) -> None:  # type: ignore[no-untyped-def]
    ids, _ = sessions
    rc = rest(server)
    seen: list[str] = []
    page = search(rc, limit=1)
    while True:
        seen += [s.session_id for s in page.sessions]
        if page.next_cursor is None:
            break
        page = search(rc, limit=1, cursor=page.next_cursor)
    assert seen == rc.list_sessions(limit=1000).result().sessions  # same order, nothing twice


def test_assign_project(server: ServerProcess, sessions) -> None:  # type: ignore[no-untyped-def]
    ids, run_id = sessions
    rc = rest(server)
    rc.assign_session_project(ids[1], "proj-moved").result()
    assert [s.session_id for s in search(rc, project_ids=["proj-moved"]).sessions] == [ids[1]]
    assert status_of(lambda: rest(server, "b").assign_session_project(ids[1], "stolen").result()) == 404
    with pytest.raises(Exception, match="not offered"):  # an honest "failed", not a fake trace
        rc.export_session_trace(ids[0]).result()
