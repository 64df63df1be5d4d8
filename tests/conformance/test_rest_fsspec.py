"""Checkpoints on an fsspec URL instead of a local folder (TWINKLE_STORAGE_URL=memory://...: the embedded gateway
and worker share one process, so they share the in-memory filesystem): save, load, signed download, delete."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import httpx
import pytest
import tinker

from tests.conformance.rest_support import batch, rest, status_of, trained_client
from tests.support.server import ServerProcess


@pytest.fixture(scope="module")
def srv(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    pytest.importorskip("fsspec")
    env = {"TWINKLE_STORAGE_URL": "memory://twinkle-checkpoints"}
    s = ServerProcess(tmp_path_factory.mktemp("fsspec-server"), str(tiny_model_dir), env=env)
    s.api_key_a = s.create_key("tenant-a")  # type: ignore[attr-defined]
    s.start()
    yield s
    s.stop()


def test_checkpoints_live_in_the_fsspec_store(srv: ServerProcess) -> None:
    data = batch(21)
    with tinker.ServiceClient(base_url=srv.base_url, api_key=srv.api_key_a) as sc:  # type: ignore[attr-defined]
        tc = trained_client(sc, srv.base_model, steps=2, seed=21)
        before = [o["logprobs"].tolist() for o in tc.forward(data, "cross_entropy").result().loss_fn_outputs]
        state = tc.save_state("remote").result().path
        export = tc.save_weights_external("remote-export").result().path
        resumed = sc.create_training_client_from_state_with_optimizer(state).result()
        after = [o["logprobs"].tolist() for o in resumed.forward(data, "cross_entropy").result().loss_fn_outputs]
    for x, y in zip(before, after):
        assert x == pytest.approx(y, abs=1e-5)
    assert not list((srv.data_dir / "checkpoints").rglob("*.safetensors"))  # nothing went to the local folder

    rc = rest(srv)
    listed = {c.tinker_path: c for c in rc.list_checkpoints(tc.model_id).result().checkpoints}
    assert listed[state].size_bytes and listed[export].size_bytes
    urls = rc.get_external_weights_urls(export).result().urls
    sizes = {rel: len(httpx.get(url).content) for rel, url in urls.items()}
    assert sum(sizes.values()) == listed[export].size_bytes and sizes["adapter_model.safetensors"] > 0

    rc.delete_checkpoint_from_tinker_path(export).result()
    assert httpx.get(urls["adapter_config.json"]).status_code == 404
    rc.delete_checkpoint_from_tinker_path(state).result()
    with tinker.ServiceClient(base_url=srv.base_url, api_key=srv.api_key_a) as sc:  # type: ignore[attr-defined]
        assert status_of(lambda: sc.create_training_client_from_state(state).result()) == 404
