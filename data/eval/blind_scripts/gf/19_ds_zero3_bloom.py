"""
Multilingual instruction tuning of bloom-7b1 with DeepSpeed ZeRO-3, parameters and optimizer
state offloaded to CPU, on our 4 x A100-80GB box (gpu-node-03).

    deepspeed --num_gpus 4 19_ds_zero3_bloom.py --data data/xp3_subset.jsonl --out runs/bloom7b-xp3
"""
import argparse
import json
import math
import os
import time

import deepspeed
import torch
import torch.distributed as dist
from datasets import load_dataset
from torch.utils.data import DataLoader, DistributedSampler
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.integrations import HfDeepSpeedConfig

DS_CONFIG = {
    "train_batch_size": 256,
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 8,
    "gradient_clipping": 1.0,
    "bf16": {"enabled": True},
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": 2e-5, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.0},
    },
    "scheduler": {
        "type": "WarmupDecayLR",
        "params": {"warmup_min_lr": 0, "warmup_max_lr": 2e-5, "warmup_num_steps": 100, "total_num_steps": 3000},
    },
    "zero_optimization": {
        "stage": 3,
        "offload_param": {"device": "cpu", "pin_memory": True},
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "overlap_comm": True,
        "contiguous_gradients": True,
        "sub_group_size": 1e9,
        "reduce_bucket_size": 4.2e7,
        "stage3_prefetch_bucket_size": 3.8e7,
        "stage3_param_persistence_threshold": 4.1e4,
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
    "steps_per_print": 20,
    "wall_clock_breakdown": False,
}


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="bigscience/bloom-7b1")
    p.add_argument("--data", required=True)
    p.add_argument("--out", default="runs/bloom7b")
    p.add_argument("--max_len", type=int, default=1024)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--save_every", type=int, default=500)
    p.add_argument("--local_rank", type=int, default=-1)
    return p.parse_args()


def tokenize_fn(tok, max_len):
    def fn(ex):
        prompt = tok(ex["inputs"], add_special_tokens=False)["input_ids"]
        target = tok(ex["targets"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        ids = (prompt + target)[-max_len:]
        labels = ([-100] * len(prompt) + target)[-max_len:]
        return {"input_ids": ids, "labels": labels}
    return fn


def collate_with(pad_id):
    def collate(rows):
        n = max(len(r["input_ids"]) for r in rows)
        ids = torch.full((len(rows), n), pad_id)
        labels = torch.full((len(rows), n), -100)
        mask = torch.zeros((len(rows), n), dtype=torch.long)
        for i, r in enumerate(rows):
            k = len(r["input_ids"])
            ids[i, :k] = torch.tensor(r["input_ids"])
            labels[i, :k] = torch.tensor(r["labels"])
            mask[i, :k] = 1
        return {"input_ids": ids, "labels": labels, "attention_mask": mask}
    return collate


def main():
    args = parse()
    deepspeed.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", args.local_rank))
    torch.cuda.set_device(local_rank)

    # must exist before from_pretrained so the weights are loaded straight into ZeRO-3 partitions
    dschf = HfDeepSpeedConfig(DS_CONFIG)  # noqa: F841  (keep alive)

    tok = AutoTokenizer.from_pretrained(args.model)
    config = AutoConfig.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, config=config, torch_dtype=torch.bfloat16)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    raw = load_dataset("json", data_files=args.data, split="train")
    ds = raw.map(tokenize_fn(tok, args.max_len), remove_columns=raw.column_names, num_proc=8)
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(ds, batch_size=DS_CONFIG["train_micro_batch_size_per_gpu"], sampler=sampler,
                        collate_fn=collate_with(tok.pad_token_id), num_workers=2, drop_last=True)

    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=DS_CONFIG)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "ds_config.json"), "w") as f:
            json.dump(DS_CONFIG, f, indent=2)

    gas = engine.gradient_accumulation_steps()
    micro = 0
    t0 = time.time()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        engine.train()
        for batch in loader:
            batch = {k: v.to(engine.device, non_blocking=True) for k, v in batch.items()}
            out = engine(**batch)
            engine.backward(out.loss)
            engine.step()
            micro += 1
            if micro % gas:
                continue
            step = micro // gas
            if step % 10 == 0:
                loss = out.loss.detach()
                dist.all_reduce(loss, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"epoch {epoch} step {step} loss {loss.item():.4f} lr {engine.get_lr()[0]:.2e} "
                          f"{(time.time() - t0) / 10:.1f}s/step", flush=True)
                    t0 = time.time()
            if step % args.save_every == 0:
                engine.save_checkpoint(os.path.join(args.out, "ds_ckpt"), tag=f"step{step}")

    engine.save_checkpoint(os.path.join(args.out, "ds_ckpt"), tag="final")
    engine.save_16bit_model(os.path.join(args.out, "final"))
    if rank == 0:
        tok.save_pretrained(os.path.join(args.out, "final"))
        config.save_pretrained(os.path.join(args.out, "final"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
