"""SFT a new identity with twinkle-kit's own client (twinkle_client, twinkle-kit==0.5.1), the cookbook's way.

The data is prepared client-side by twinkle itself: `Dataset` over data/self_cognition.jsonl (swift's
self-cognition format, {{NAME}} / {{AUTHOR}} placeholders), `SelfCognitionProcessor` fills in the identity,
`Template` encodes the rows with the model's tokenizer (a local folder: `--tokenizer`, default the base model's
name, which twinkle resolves as a folder or downloads from a hub), and `DataLoader` batches them. The server trains
a `MultiLoraTransformersModel` LoRA with CrossEntropyLoss and AdamW, saves it for sampling, and `vLLMSampler`
answers a question that is not in the data with that adapter. Signal: each step's training loss (per label token)
and the loss over the whole data set before and after training (`forward_only`).

    pip install twinkle-kit==0.5.1 "peft<=0.19" "numpy<2.3" torch transformers datasets pillow
    TWINKLE_API_KEY=tml-... python examples/sft_self_cognition_native.py --tokenizer /path/to/model --steps 40

Last line: {"example": "sft_self_cognition_native", "first_loss": ..., "last_loss": ..., "answer": ...}
"""

from __future__ import annotations

import numpy as np
from peft import LoraConfig
from twinkle.dataloader import DataLoader
from twinkle.dataset import Dataset, DatasetMeta
from twinkle_client import init_twinkle_client
from twinkle_client.model import MultiLoraTransformersModel
from twinkle_client.sampler import vLLMSampler

from _common import DATA, parser, require_key, summary

QUESTION = "Please tell me your name and who created you."  # not in the data


def plain(obj):  # type: ignore[no-untyped-def]
    """numpy values -> JSON lists / numbers (the model client sends `inputs` as they are)."""
    if isinstance(obj, dict):
        return {k: plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [plain(v) for v in obj]
    return obj.tolist() if hasattr(obj, "tolist") else obj


def main() -> None:
    p = parser(__doc__, steps=40, lr=5e-4)
    p.add_argument("--tokenizer", default=None, help="the model's tokenizer folder for twinkle's Template")
    p.add_argument("--name", default="Blinky")
    p.add_argument("--author", default="the Twinkle team")
    p.add_argument("--batch-size", type=int, default=4)
    args = p.parse_args()
    client = init_twinkle_client(base_url=args.base_url, api_key=require_key(args))
    try:
        base = args.base_model or client.get_server_capabilities().supported_models[0].model_name

        dataset = Dataset(DatasetMeta(str(DATA / "self_cognition.jsonl")))
        dataset.set_template("Template", model_id=args.tokenizer or base, max_length=256)
        dataset.map("SelfCognitionProcessor", init_args={"model_name": args.name, "model_author": args.author})
        dataset.encode(batched=True)
        batches = [plain(b) for b in DataLoader(dataset=dataset, batch_size=args.batch_size)]

        model = MultiLoraTransformersModel(model_id=base)
        model.add_adapter_to_model("identity", LoraConfig(r=args.rank, target_modules="all-linear"),
                                   gradient_accumulation_steps=1)
        model.set_template("Template")
        model.set_processor("InputProcessor", padding_side="right")
        model.set_loss("CrossEntropyLoss")
        model.set_optimizer("AdamW", lr=args.lr)

        def data_loss() -> float:
            """Mean NLL per label token over the whole data set, from forward_only's per-token logps."""
            nll = []
            for b in batches:
                for logps, row in zip(model.forward_only(inputs=b).result["logps"], b):
                    nll += [-lp for lp, label in zip(logps, row["labels"]) if label != -100]
            return float(np.mean(nll))

        first = data_loss()
        print(f"loss over the data before training {first:.4f}")
        for step in range(args.steps):
            out = model.forward_backward(inputs=batches[step % len(batches)]).result
            model.clip_grad_and_step()
            print(f"step {step:3d}  loss {float(out['loss']):.4f}", flush=True)
        metric = model.calculate_metric(is_training=True).result
        last = data_loss()
        print(f"loss over the data after training {last:.4f}; train metric {metric}")

        adapter = model.save(name="identity-sampler", is_sampler=True).twinkle_path
        sampler = vLLMSampler(model_id=base)
        sampler.set_template("Template", model_id=base)
        params = {"max_tokens": 40, "temperature": 0, "logprobs": 1}
        seq = sampler.sample(inputs=[{"messages": [{"role": "user", "content": QUESTION}]}],
                             sampling_params=params, adapter_uri=adapter)[0].sequences[0]
        answer = (seq.decoded or "").strip()
        print(f"trained adapter {adapter} on {QUESTION!r}: {answer!r}")
        summary("sft_self_cognition_native", base_model=base, steps=args.steps, first_loss=first, last_loss=last,
                answer=answer, mentions_name=args.name.lower() in answer.lower(), adapter=adapter)
    finally:
        client.close()


if __name__ == "__main__":
    main()
