"""twinkle-kit 0.5.1's README example "Access the Serverless Training Services via Tinker-compatible API", as written
there (only the base model, the data source and the step count differ): data prepared with twinkle's local Dataset /
SelfCognitionProcessor / DataLoader, turned into Tinker datums by `twinkle.server.common.input_feature_to_datum`, and
trained through the stock tinker 0.16.1 SDK after `twinkle.init_tinker_client()`. Only Tinker routes are involved.
Run by scripts/test_native.sh."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.native.conftest import MODEL_NAME, NativeServer

pytestmark = pytest.mark.timeout(300)


def test_seed_tinker_example(native_server: NativeServer, sc_jsonl: Path) -> None:
    srv = native_server
    from tinker import types
    from twinkle import init_tinker_client
    from twinkle.dataloader import DataLoader
    from twinkle.dataset import Dataset, DatasetMeta
    from twinkle.preprocessor import SelfCognitionProcessor
    from twinkle.server.common import input_feature_to_datum

    dataset = Dataset(dataset_meta=DatasetMeta(str(sc_jsonl)))
    dataset.set_template("Template", model_id=str(srv.model_dir), max_length=256)
    dataset.map(SelfCognitionProcessor("twinkle Model", "ModelScope Team"), load_from_cache_file=False)
    dataset.encode(batched=True, load_from_cache_file=False)
    dataloader = DataLoader(dataset=dataset, batch_size=4)

    init_tinker_client()
    from tinker import ServiceClient

    service_client = ServiceClient(base_url=srv.base_url, api_key=srv.api_key_a)  # type: ignore[attr-defined]
    training_client = service_client.create_lora_training_client(base_model=MODEL_NAME, rank=8)

    losses = []
    for epoch in range(4):
        for batch in dataloader:
            input_datum = [input_feature_to_datum(input_feature) for input_feature in batch]
            fwdbwd_future = training_client.forward_backward(input_datum, "cross_entropy")
            optim_future = training_client.optim_step(types.AdamParams(learning_rate=5e-3))
            fwdbwd_result = fwdbwd_future.result()
            optim_future.result()
            losses.append(fwdbwd_result.metrics["loss:sum"])
        path = training_client.save_state(f"twinkle-lora-{epoch}").result().path
        assert path.endswith(f"/weights/twinkle-lora-{epoch}")
    assert len(losses) == 8
    # the same two batches, first vs last epoch (lr 5e-3: 2e-2 overshot now and then on the summed loss's scale)
    assert losses[-2] + losses[-1] < (losses[0] + losses[1]) * 0.9, losses
