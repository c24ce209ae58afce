"""Supervised fine-tuning of a 7B decoder with DeepSpeed ZeRO-3.

    deepspeed --hostfile hostfile --num_nodes 2 --num_gpus 8 06_ds_zero3_sft_llama.py \
        --model /models/llama-2-7b-hf --data /data/sft/mix_v3.jsonl --out /fsx/sft/llama7b_v3

Resumes from the latest DeepSpeed tag in --out/ckpt on restart.  The best model
(by validation loss) is exported to --out/best in HF format for the eval team.
"""
import argparse
import json
import math
import os
import random
import time

import deepspeed
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer

IGNORE_INDEX = -100
PROMPT = "### Instruction:\n{instruction}\n\n### Response:\n"


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--max-len", type=int, default=2048)
    p.add_argument("--micro-bsz", type=int, default=2)
    p.add_argument("--grad-accum", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--val-frac", type=float, default=0.02)
    p.add_argument("--eval-steps", type=int, default=200)
    p.add_argument("--patience", type=int, default=5)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--local_rank", type=int, default=-1)  # injected by the deepspeed launcher
    return p.parse_args()


def ds_config(args):
    return {
        "train_micro_batch_size_per_gpu": args.micro_bsz,
        "gradient_accumulation_steps": args.grad_accum,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "zero_optimization": {
            "stage": 3,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "reduce_bucket_size": 5e8,
            "stage3_prefetch_bucket_size": 5e8,
            "stage3_param_persistence_threshold": 1e6,
            "stage3_max_live_parameters": 1e9,
        },
        "optimizer": {"type": "AdamW",
                      "params": {"lr": args.lr, "betas": [0.9, 0.95], "weight_decay": 0.0}},
        "scheduler": {"type": "WarmupCosineLR",
                      "params": {"total_num_steps": 10000, "warmup_num_steps": 100,
                                 "warmup_type": "linear"}},
        "steps_per_print": 50,
        "wall_clock_breakdown": False,
    }


class SFTData(Dataset):
    def __init__(self, rows, tok, max_len):
        self.rows, self.tok, self.max_len = rows, tok, max_len

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        prompt = PROMPT.format(instruction=r["instruction"].strip())
        p_ids = self.tok(prompt, add_special_tokens=True)["input_ids"]
        a_ids = self.tok(r["output"].strip() + self.tok.eos_token, add_special_tokens=False)["input_ids"]
        ids = (p_ids + a_ids)[: self.max_len]
        labels = ([IGNORE_INDEX] * len(p_ids) + a_ids)[: self.max_len]
        return torch.tensor(ids), torch.tensor(labels)


def collate(pad_id):
    def fn(batch):
        n = max(len(x) for x, _ in batch)
        ids = torch.full((len(batch), n), pad_id)
        lab = torch.full((len(batch), n), IGNORE_INDEX)
        att = torch.zeros((len(batch), n), dtype=torch.long)
        for i, (x, y) in enumerate(batch):
            ids[i, : len(x)], lab[i, : len(y)], att[i, : len(x)] = x, y, 1
        return ids, att, lab
    return fn


@torch.no_grad()
def evaluate(engine, loader):
    engine.eval()
    tot = torch.zeros(2, device=engine.device)
    for ids, att, lab in loader:
        ids, att, lab = ids.to(engine.device), att.to(engine.device), lab.to(engine.device)
        out = engine(input_ids=ids, attention_mask=att, labels=lab)
        ntok = (lab[:, 1:] != IGNORE_INDEX).sum()
        tot[0] += out.loss.float() * ntok
        tot[1] += ntok
    dist.all_reduce(tot)
    engine.train()
    return (tot[0] / tot[1].clamp(min=1)).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    deepspeed.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()

    tok = AutoTokenizer.from_pretrained(args.model, use_fast=True)
    tok.pad_token = tok.pad_token or tok.unk_token
    with open(args.data) as f:
        rows = [json.loads(l) for l in f]
    rng = random.Random(args.seed)  # same seed on every rank -> same split
    rng.shuffle(rows)
    n_val = int(len(rows) * args.val_frac)
    val_rows, train_rows = rows[:n_val], rows[n_val:]

    train_ds = SFTData(train_rows, tok, args.max_len)
    val_ds = SFTData(val_rows, tok, args.max_len)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    val_sampler = DistributedSampler(val_ds, shuffle=False, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.micro_bsz, sampler=train_sampler,
                          collate_fn=collate(tok.pad_token_id), num_workers=2, drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=args.micro_bsz, sampler=val_sampler,
                        collate_fn=collate(tok.pad_token_id), num_workers=2)

    cfg = ds_config(args)
    updates = math.ceil(len(train_dl) / args.grad_accum) * args.epochs
    cfg["scheduler"]["params"]["total_num_steps"] = updates
    cfg["scheduler"]["params"]["warmup_num_steps"] = max(10, int(0.03 * updates))

    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16)
    model.gradient_checkpointing_enable()
    model.config.use_cache = False
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)

    ckpt_dir = os.path.join(args.out, "ckpt")
    best_dir = os.path.join(args.out, "best")
    start_epoch, micro_step, best_val, bad = 0, 0, float("inf"), 0
    if os.path.exists(os.path.join(ckpt_dir, "latest")):
        _, client = engine.load_checkpoint(ckpt_dir)
        start_epoch, micro_step = client["epoch"], client["micro_step"]
        best_val, bad = client["best_val"], client["bad"]
        if rank == 0:
            print(f"resumed: epoch {start_epoch}, micro step {micro_step}, best {best_val:.4f}")

    stop = False
    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        skip = micro_step if epoch == start_epoch else 0
        t0 = time.time()
        for i, (ids, att, lab) in enumerate(train_dl):
            if i < skip:
                continue
            ids, att, lab = ids.to(engine.device), att.to(engine.device), lab.to(engine.device)
            loss = engine(input_ids=ids, attention_mask=att, labels=lab).loss
            engine.backward(loss)
            engine.step()

            if engine.is_gradient_accumulation_boundary() and rank == 0 and engine.global_steps % 10 == 0:
                print(f"ep {epoch} upd {engine.global_steps} loss {loss.item():.4f} "
                      f"lr {engine.get_lr()[0]:.2e} {time.time() - t0:.1f}s", flush=True)
                t0 = time.time()

            if engine.is_gradient_accumulation_boundary() and engine.global_steps % args.eval_steps == 0:
                val_loss = evaluate(engine, val_dl)
                if val_loss < best_val:
                    best_val, bad = val_loss, 0
                    if rank == 0:
                        os.makedirs(best_dir, exist_ok=True)
                        engine.module.save_pretrained(best_dir, safe_serialization=True)
                        tok.save_pretrained(best_dir)
                    dist.barrier()
                else:
                    bad += 1
                if rank == 0:
                    print(f"[eval] upd {engine.global_steps} val_loss {val_loss:.4f} "
                          f"best {best_val:.4f} bad {bad}/{args.patience}", flush=True)
                engine.save_checkpoint(ckpt_dir, client_state={
                    "epoch": epoch, "micro_step": i + 1, "best_val": best_val, "bad": bad})
                # val_loss is all-reduced, so every rank reaches the same decision
                if bad >= args.patience:
                    stop = True
                    break
        if stop:
            break

    if rank == 0:
        print(f"done, best val loss {best_val:.4f}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
