"""Several tenants train their own DPO LoRAs at once on one base model (stock tinker SDK, tinker==0.38.0).

Each tenant is a thread with its own API key, ServiceClient and LoRA adapter, running the loop of dpo_lora.py
(reference logprobs from the base model, the DPO loss as a `forward_backward_custom` callable). The server merges
the tenants' concurrent forward/backward passes into shared passes over the one base model while each adapter gets
only its own gradients. To show the adapters stay apart, the tenants want opposite things: even-numbered tenants
prefer the helpful answers of data/dpo_pairs.jsonl, odd-numbered ones the curt answers; each one's margin grows in
its own direction. Signal: every tenant's DPO loss per step.

Keys: `--api-keys tml-a,tml-b` (or $TWINKLE_API_KEYS, comma-separated); or, on the server's machine,
`--data-dir D --tenants N` creates N tenants' keys with `twinkle-server keys create`.

    TWINKLE_API_KEYS=tml-...,tml-... python examples/dpo_multi_tenant.py --steps 10

Last line: {"example": "dpo_multi_tenant", "tenants": [{"first_loss": ..., "last_loss": ..., ...}, ...], ...}
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time

import tinker

from _common import first_served_model, parser, summary
from dpo_lora import add_dpo_args, train_dpo


def create_keys(data_dir: str, n: int) -> list[str]:
    cli = [shutil.which("twinkle-server")] if shutil.which("twinkle-server") else [sys.executable, "-m", "deploy.cli"]
    keys = []
    for i in range(n):
        out = subprocess.run([*cli, "keys", "create", "--tenant", f"dpo-tenant-{i}", "--data-dir", data_dir],
                             capture_output=True, text=True, check=True)
        keys.append(out.stdout.strip().splitlines()[-1])
    return keys


def main() -> None:
    p = add_dpo_args(parser(__doc__, steps=10, lr=5e-4))
    p.add_argument("--api-keys", default=os.environ.get("TWINKLE_API_KEYS"), help="comma-separated tml-... keys")
    p.add_argument("--data-dir", default=None, help="the server's data dir: create the tenants' keys there")
    p.add_argument("--tenants", type=int, default=2, help="how many tenants to create with --data-dir")
    args = p.parse_args()
    if args.data_dir:
        keys = create_keys(args.data_dir, args.tenants)
    elif args.api_keys:
        keys = [k.strip() for k in args.api_keys.split(",") if k.strip()]
    else:
        raise SystemExit("pass --api-keys k1,k2 (or $TWINKLE_API_KEYS), or --data-dir D --tenants N")
    base = args.base_model or first_served_model(args.base_url, keys[0])

    results: list[dict | None] = [None] * len(keys)
    errors: list[BaseException] = []

    def tenant(i: int) -> None:
        try:
            with tinker.ServiceClient(base_url=args.base_url, api_key=keys[i]) as sc:
                prefers = "curt" if i % 2 else "helpful"
                results[i] = {"tenant": i, "prefers": prefers,
                              **train_dpo(sc, base, args, swap=bool(i % 2), label=f"[tenant {i} {prefers:7s}] ")}
        except BaseException as err:  # noqa: BLE001  (reported below)
            errors.append(err)

    start = time.monotonic()
    threads = [threading.Thread(target=tenant, args=(i,)) for i in range(len(keys))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    wall = time.monotonic() - start
    summary("dpo_multi_tenant", base_model=base, steps=args.steps, wall_s=round(wall, 2), tenants=results,
            all_losses_fell=all(r is not None and r["last_loss"] < r["first_loss"] for r in results))


if __name__ == "__main__":
    main()
