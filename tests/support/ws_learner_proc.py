"""One rank of a 2-process FSDP2 (gloo) learner that publishes weights; driven by test_weight_sync.py.

Scenario (rank 0 drives the receivers, both ranks gather):
  v1 -> r0, r1; dump the full state dict                       (bit-identical check)
  v2 -> r0, r1 with r1 SIGKILLed after the second bucket        (fail fast, name r1)
  v3 -> survivors (r0) after a rebuild; HF export of v3          (publish recovers)
  late joiner r2 loads the v3 export, joins; v4 -> r0, r2         (late join)
Each version follows one real SGD step. Results go to ``--out/result.json``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.fsdp import fully_shard
from transformers import Qwen2Config, Qwen2ForCausalLM

from weight_sync.config import WeightSyncConfig
from weight_sync.plan import build_plan
from weight_sync.publisher import Publisher, PublishError
from weight_sync.receiver_client import ReceiverClient


def tiny_model() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    return Qwen2ForCausalLM(cfg)


def full_params(model):
    for name, p in model.named_parameters():
        yield name, p.full_tensor().detach()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--urls", required=True, help="r0=url,r1=url,r2=url")
    ap.add_argument("--kill-pid", type=int, required=True, help="pid of r1")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s learner %(name)s %(message)s")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    out = Path(args.out)
    model = tiny_model()
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    gen = torch.Generator().manual_seed(1)

    def step() -> None:
        ids = torch.randint(0, 256, (2, 16), generator=gen)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()

    meta = [(n, list(p.shape), p.dtype) for n, p in model.named_parameters()]
    plan = build_plan(meta, bucket_bytes=64 * 1024)  # small buckets: many of them for a 0.3M model
    urls = dict(kv.split("=", 1) for kv in args.urls.split(","))
    clients = {k: ReceiverClient(k, u, timeout_s=20) for k, u in urls.items()}
    cfg = WeightSyncConfig(backend="gloo", timeout_s=20)
    if rank == 0:  # the receivers start alongside us; wait (bounded) until they serve
        import asyncio

        async def ready() -> None:
            deadline = time.monotonic() + 90
            for c in clients.values():
                while not await c.health():
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"receiver {c.engine_id} not healthy within 90s")
                    await asyncio.sleep(0.2)
            for c in clients.values():
                await c.close()  # the publisher's loop re-creates the HTTP session

        asyncio.run(ready())
    pub = Publisher(cfg, plan, rank=rank, engines=[clients["r0"], clients["r1"]] if rank == 0 else ())
    result: dict = {"buckets": len(plan.buckets)}

    def save_full(tag: str) -> None:
        full = {n: t.clone() for n, t in full_params(model)}  # collective: both ranks
        if rank == 0:
            save_file(full, str(out / f"learner_{tag}.safetensors"))

    step()
    rep = pub.publish(1, full_params(model))
    save_full("v1")
    if rank == 0:
        result["v1"] = {"engines": rep.engines, "checksum": rep.checksum, "seconds": rep.seconds}
        for k in ("r0", "r1"):
            pub.call(clients[k].dump(str(out / f"{k}_v1.safetensors")), 20, f"dump {k}")

    step()

    def killing(it):
        for i, item in enumerate(it):
            if rank == 0 and i == len(plan.buckets[0]) + len(plan.buckets[1]):
                os.kill(args.kill_pid, signal.SIGKILL)
            yield item

    t0 = time.perf_counter()
    try:
        pub.publish(2, killing(full_params(model)))
        if rank == 0:
            result["v2"] = {"error": None}
    except PublishError as e:
        result["v2"] = {"error": str(e), "blamed": e.blamed, "seconds": time.perf_counter() - t0}

    step()
    rep = pub.publish(3, full_params(model))
    save_full("v3")
    if rank == 0:
        result["v3"] = {"engines": rep.engines, "epoch": rep.epoch}
        pub.call(clients["r0"].dump(str(out / "r0_v3.safetensors")), 20, "dump r0")
    export = out / "export_v3"
    full = {n: t.clone() for n, t in full_params(model)}
    if rank == 0:
        export.mkdir()
        save_file(full, str(export / "model.safetensors"))
        pub.add_engine(clients["r2"], export_path=str(export), version=3)
        # The joiner is not in the group yet; what it holds must be the export.
        pub.call(clients["r2"].dump(str(out / "r2_after_export.safetensors")), 20, "dump r2")

    step()
    rep = pub.publish(4, full_params(model))
    save_full("v4")
    if rank == 0:
        result["v4"] = {"engines": sorted(rep.engines), "epoch": rep.epoch, "bytes": rep.bytes}
        for k in ("r0", "r2"):
            pub.call(clients[k].dump(str(out / f"{k}_v4.safetensors")), 20, f"dump {k}")
        (out / "result.json").write_text(json.dumps(result, indent=1))
    pub.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
