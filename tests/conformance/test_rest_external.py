"""save_weights_external + get_external_weights_urls with the stock SDK: the files behind the signed URLs are a PEFT
adapter that, loaded with PeftModel.from_pretrained, gives the same logprobs as the server's forward."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import datetime, timedelta, timezone
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
import tinker

from tests.conformance.rest_support import batch, rest, status_of, trained_client
from tests.support.peft_check import assert_logprobs_match_peft
from tests.support.server import ServerProcess


def test_external_weights_download_loads_in_peft(server: ServerProcess, tmp_path: Path) -> None:
    pytest.importorskip("peft")

    data = batch(11)
    with tinker.ServiceClient(base_url=server.base_url, api_key=server.api_key_a) as sc:
        tc = trained_client(sc, server.base_model, steps=3, seed=11)
        fwd = tc.forward(data, "cross_entropy").result()
        saved = tc.save_weights_external("export", ttl_seconds=3 * 3600).result()
    assert saved.path == f"tinker://{tc.model_id}/external_weights/export"

    rc = rest(server)
    listed = {c.tinker_path: c for c in rc.list_checkpoints(tc.model_id).result().checkpoints}
    assert listed[saved.path].checkpoint_type == "external" and listed[saved.path].expires_at is not None

    signed = rc.get_external_weights_urls(saved.path).result()
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(signed.urls)
    assert timedelta(minutes=50) < signed.expires - datetime.now(timezone.utc) <= timedelta(hours=1)
    for rel, url in signed.urls.items():
        assert urlsplit(url).netloc == urlsplit(server.base_url).netloc  # served by the gateway itself
        resp = httpx.get(url)  # no API key: the signature is the permission
        assert resp.status_code == 200, (rel, resp.text)
        target = tmp_path / "adapter" / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(resp.content)

    assert_logprobs_match_peft(server.base_model, tmp_path / "adapter", data, fwd.loss_fn_outputs)

    url = signed.urls["adapter_config.json"]
    rc.delete_checkpoint_from_tinker_path(saved.path).result()
    assert httpx.get(url).status_code == 404  # deleted: the URL opens nothing any more
    assert status_of(lambda: rc.get_external_weights_urls(saved.path).result()) == 404


def test_external_weights_reject_encryption_and_training_load(server: ServerProcess) -> None:
    with tinker.ServiceClient(base_url=server.base_url, api_key=server.api_key_a) as sc:
        tc = trained_client(sc, server.base_model, steps=0)
        age = ["age1ql3z7hjy54pw3hyww5ayyfg7zqgvc7w3j2elw8zmrj2kg5sfn9aqmcac8p"]
        assert status_of(lambda: tc.save_weights_external("enc", age_encryption_recipients=age).result()) == 400
        path = tc.save_weights_external("plain").result().path
        assert status_of(lambda: sc.create_training_client_from_state(path).result()) == 400
        with pytest.raises(ValueError):  # the SDK itself refuses URLs for non-external checkpoints
            rest(server).get_external_weights_urls(tc.save_state("st").result().path)


def test_tinker_cli_downloads_a_training_checkpoint(server: ServerProcess, tmp_path: Path) -> None:
    """`tinker checkpoint download` of a weights/ path: load, temporary export, signed URLs, delete, close."""
    with tinker.ServiceClient(base_url=server.base_url, api_key=server.api_key_a) as sc:
        tc = trained_client(sc, server.base_model, steps=1, seed=12)
        path = tc.save_state("cli").result().path
        sampler = tc.save_weights_for_sampler("cli-sampler").result().path
    env = {**os.environ, "TINKER_BASE_URL": server.base_url, "TINKER_API_KEY": server.api_key_a}  # type: ignore[attr-defined]
    out = subprocess.run([str(Path(sys.executable).with_name("tinker")), "checkpoint", "download", path,
                          "--output", str(tmp_path)], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    (folder,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    got = {f.name: f.read_bytes() for f in folder.iterdir()}
    run_id, kind, name = sampler.removeprefix("tinker://").split("/")
    (expected,) = server.data_dir.glob(f"checkpoints/*/{run_id}/{kind}/{name}")
    assert got["adapter_model.safetensors"] == (expected / "adapter_model.safetensors").read_bytes()
    assert "adapter_config.json" in got
    temporary = [c for c in rest(server).list_user_checkpoints(limit=1000).result().checkpoints
                 if c.checkpoint_type == "external" and c.tinker_path.endswith("/download")]
    assert temporary == []  # the CLI deleted its temporary export
