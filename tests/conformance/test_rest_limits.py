"""Storage quota, TTL expiry and unsettled saves, on a server of their own (quota 200 kB, maintenance every second).

The quota is checked twice: the gateway refuses a save with a 403 when even a checkpoint the size of the run's last
one would not fit, and the worker fails a save (category user) whose files turn out bigger than what is left.
"""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path
from typing import Iterator

import httpx
import pytest
import tinker

from tests.conformance.rest_support import rest, status_of, trained_client
from tests.support.server import ServerProcess

QUOTA = 200_000


@pytest.fixture(scope="module")
def srv(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    env = {"TWINKLE_TENANT_STORAGE_QUOTA_BYTES": str(QUOTA), "TWINKLE_MAINTENANCE_INTERVAL_SECONDS": "1"}
    s = ServerProcess(tmp_path_factory.mktemp("limits-server"), str(tiny_model_dir), env=env)
    s.api_key_a = s.create_key("tenant-a")  # type: ignore[attr-defined]
    s.api_key_b = s.create_key("tenant-b")  # type: ignore[attr-defined]
    s.api_key_c = s.create_key("tenant-c")  # type: ignore[attr-defined]
    s.start()
    yield s
    s.stop()


def used(srv: ServerProcess, key: str = "a") -> int:
    return sum(c.size_bytes or 0 for c in rest(srv, key).list_user_checkpoints(limit=1000).result().checkpoints)


def wait_until(cond, timeout: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.25)


def test_quota_rejects_saves_with_a_clear_4xx(srv: ServerProcess) -> None:
    with tinker.ServiceClient(base_url=srv.base_url, api_key=srv.api_key_c) as sc:  # type: ignore[attr-defined]
        tc = trained_client(sc, srv.base_model, steps=1)
        saved: list[str] = []
        try:
            for i in range(20):
                try:
                    saved.append(tc.save_weights_for_sampler(f"w{i}").result().path)
                except tinker.APIStatusError as e:
                    assert e.status_code == 403 and "quota" in str(e), e
                    break
            else:
                pytest.fail("the quota never stopped a save")
            size = used(srv, "c") // len(saved)
            assert len(saved) >= 2 and used(srv, "c") <= QUOTA < used(srv, "c") + size
            assert status_of(lambda: tc.save_weights_for_sampler("again").result()) == 403  # stays refused

            rest(srv, "c").delete_checkpoint_from_tinker_path(saved.pop()).result()
            free = QUOTA - used(srv, "c")
            with pytest.raises(tinker.RequestFailedError) as too_big:  # more than what is left: the worker refuses
                tc.save_state("with-optimizer").result()
            assert "quota" in str(too_big.value) and size <= free < 2 * size
            listed = rest(srv, "c").list_checkpoints(tc.model_id).result().checkpoints
            assert not [c for c in listed if c.checkpoint_id == "weights/with-optimizer"]
            saved.append(tc.save_weights_for_sampler("fits").result().path)
            tc.save_weights_for_sampler("fits").result()  # overwriting does not count the replaced copy twice
            assert used(srv, "c") <= QUOTA
            for path in saved[:-1]:  # keep only "fits": now the training state fits
                rest(srv, "c").delete_checkpoint_from_tinker_path(path).result()
            del saved[:-1]
            saved.append(tc.save_state("with-optimizer").result().path)  # the refused save left no trace behind
            with tinker.ServiceClient(base_url=srv.base_url, api_key=srv.api_key_b) as sc_b:  # type: ignore[attr-defined]
                b_path = trained_client(sc_b, srv.base_model, steps=0).save_weights_for_sampler("b1").result().path
            rest(srv, "b").delete_checkpoint_from_tinker_path(b_path).result()  # quotas are per tenant
        finally:
            for path in saved:
                rest(srv, "c").delete_checkpoint_from_tinker_path(path).result()


def test_expired_checkpoints_are_swept(srv: ServerProcess) -> None:
    with tinker.ServiceClient(base_url=srv.base_url, api_key=srv.api_key_a) as sc:  # type: ignore[attr-defined]
        tc = trained_client(sc, srv.base_model, steps=0)
        doomed = tc.save_weights_for_sampler("doomed", ttl_seconds=3600).result().path
        kept = tc.save_weights_for_sampler("kept", ttl_seconds=3600).result().path
    run_id, kind, _ = doomed.removeprefix("tinker://").split("/")
    (folder,) = srv.data_dir.glob(f"checkpoints/*/{run_id}/{kind}/doomed")
    time.sleep(1.5)
    assert folder.exists()  # an hour is not over yet
    with sqlite3.connect(srv.data_dir / "twinkle.db", timeout=10) as db:  # let the hour pass
        db.execute("UPDATE checkpoints SET expires_at = '2000-01-01 00:00:00.000000' WHERE model_id = ? AND name = ?",
                   (run_id, "doomed"))

    def listed() -> set[str]:
        return {c.tinker_path for c in rest(srv).list_checkpoints(run_id).result().checkpoints}

    wait_until(lambda: doomed not in listed())
    assert kept in listed() and not folder.exists()
    with sqlite3.connect(srv.data_dir / "twinkle.db", timeout=10) as db:
        assert db.execute("SELECT count(*) FROM checkpoints WHERE name = 'doomed'").fetchone()[0] == 0


def test_a_save_nobody_collects_is_settled(srv: ServerProcess) -> None:
    """A save whose future is never retrieved still becomes a listed checkpoint (the maintenance loop settles it)."""
    headers = {"X-API-Key": srv.api_key_a}  # type: ignore[attr-defined]
    with tinker.ServiceClient(base_url=srv.base_url, api_key=srv.api_key_a) as sc:  # type: ignore[attr-defined]
        tc = trained_client(sc, srv.base_model, steps=0)
        tc.save_weights_for_sampler("first").result()  # seq_id 1 used
        body = {"model_id": tc.model_id, "path": "uncollected", "seq_id": 2, "type": "save_weights_for_sampler"}
        resp = httpx.post(f"{srv.base_url}/api/v1/save_weights_for_sampler", json=body, headers=headers)
        assert resp.status_code == 200, resp.text
        path = f"tinker://{tc.model_id}/sampler_weights/uncollected"
        wait_until(lambda: path in {c.tinker_path for c in rest(srv).list_checkpoints(tc.model_id).result().checkpoints})
