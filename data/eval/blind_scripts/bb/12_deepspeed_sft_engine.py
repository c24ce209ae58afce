"""SFT with a raw DeepSpeed engine (ZeRO-2, no HF Trainer), for finer control over the loop.

    deepspeed --num_gpus 8 12_deepspeed_sft_engine.py --model mistralai/Mistral-7B-v0.1 \
        --data data/sft_mix.jsonl --out runs/mistral-sft-ds
"""
import argparse
import json
import os
import time

import deepspeed
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer

DS_CONFIG = {
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": 1.0,
    "bf16": {"enabled": "auto"},
    "zero_optimization": {
        "stage": 2,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "reduce_bucket_size": 5e8,
        "allgather_bucket_size": 5e8,
    },
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": "auto", "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": "auto"},
    },
    "scheduler": {
        "type": "WarmupDecayLR",
        "params": {"warmup_min_lr": 0, "warmup_max_lr": "auto", "warmup_num_steps": "auto",
                   "total_num_steps": "auto"},
    },
    "steps_per_print": 50,
    "wall_clock_breakdown": False,
}


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="mistralai/Mistral-7B-v0.1")
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", default="runs/ds-sft")
    ap.add_argument("--max_len", type=int, default=2048)
    ap.add_argument("--micro_bsz", type=int, default=2)
    ap.add_argument("--accum", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--weight_decay", type=float, default=0.0)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--val_frac", type=float, default=0.02)
    ap.add_argument("--local_rank", type=int, default=-1)  # filled in by the deepspeed launcher
    return ap.parse_args()


class JsonlSFT(Dataset):
    def __init__(self, rows, tok, max_len):
        self.rows, self.tok, self.max_len = rows, tok, max_len

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        p = self.tok(f"[INST] {r['prompt'].strip()} [/INST]", add_special_tokens=True)["input_ids"]
        a = self.tok(" " + r["response"].strip(), add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
        ids = (p + a)[: self.max_len]
        return ids, ([-100] * len(p) + a)[: self.max_len]


def make_collate(pad_id):
    def collate(batch):
        L = max(len(x) for x, _ in batch)
        ids = torch.full((len(batch), L), pad_id, dtype=torch.long)
        lab = torch.full((len(batch), L), -100, dtype=torch.long)
        att = torch.zeros((len(batch), L), dtype=torch.long)
        for i, (x, y) in enumerate(batch):
            ids[i, : len(x)] = torch.tensor(x)
            lab[i, : len(y)] = torch.tensor(y)
            att[i, : len(x)] = 1
        return {"input_ids": ids, "labels": lab, "attention_mask": att}

    return collate


@torch.no_grad()
def evaluate(engine, loader):
    engine.eval()
    s = torch.zeros(2, device=engine.device)
    for batch in loader:
        batch = {k: v.to(engine.device) for k, v in batch.items()}
        out = engine(**batch)
        n = (batch["labels"][:, 1:] != -100).sum()
        s[0] += out.loss.float() * n
        s[1] += n
    dist.all_reduce(s)
    engine.train()
    return (s[0] / s[1]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ.get("LOCAL_RANK", args.local_rank))
    torch.cuda.set_device(local_rank)
    deepspeed.init_distributed(dist_backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()

    tok = AutoTokenizer.from_pretrained(args.model)
    tok.pad_token = tok.unk_token

    with open(args.data) as f:
        rows = [json.loads(l) for l in f if l.strip()]
    n_val = int(len(rows) * args.val_frac)
    val_rows, train_rows = rows[:n_val], rows[n_val:]
    train_ds, val_ds = JsonlSFT(train_rows, tok, args.max_len), JsonlSFT(val_rows, tok, args.max_len)

    collate = make_collate(tok.pad_token_id)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=0)
    train_dl = DataLoader(train_ds, batch_size=args.micro_bsz, sampler=train_sampler, collate_fn=collate,
                          num_workers=4, drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=args.micro_bsz,
                        sampler=DistributedSampler(val_ds, shuffle=False, drop_last=True), collate_fn=collate)

    steps_per_epoch = len(train_dl) // args.accum
    total_steps = steps_per_epoch * args.epochs

    ds_config = dict(DS_CONFIG)
    ds_config["train_micro_batch_size_per_gpu"] = args.micro_bsz
    ds_config["gradient_accumulation_steps"] = args.accum
    ds_config["train_batch_size"] = args.micro_bsz * args.accum * world

    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False

    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"world={world} train={len(train_ds)} val={len(val_ds)} total_steps={total_steps}", flush=True)

    t0 = time.time()
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        engine.train()
        for i, batch in enumerate(train_dl):
            batch = {k: v.to(engine.device, non_blocking=True) for k, v in batch.items()}
            loss = engine(**batch).loss
            engine.backward(loss)
            engine.step()
            if (i + 1) % args.accum == 0 and engine.global_steps % 20 == 0:
                l = loss.detach().float()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"epoch {epoch} step {engine.global_steps}/{total_steps} loss {l.item():.4f} "
                          f"lr {engine.get_lr()[0]:.2e} {time.time() - t0:.0f}s", flush=True)

        val_loss = evaluate(engine, val_dl)
        if rank == 0:
            print(f"epoch {epoch} val_loss {val_loss:.4f}", flush=True)
        engine.save_checkpoint(os.path.join(args.out, "ds_ckpt"), tag=f"epoch{epoch}",
                               client_state={"epoch": epoch, "val_loss": val_loss})

    if rank == 0:
        engine.module.save_pretrained(os.path.join(args.out, "hf"), safe_serialization=True)
        tok.save_pretrained(os.path.join(args.out, "hf"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
