#!/usr/bin/env python
"""
Reward model with DeepSpeed ZeRO stage 3 (Qwen2-7B backbone), exported as a plain
PyTorch state dict for the PPO stage.

    deepspeed --num_gpus=8 14_rm_qwen7b_zero3.py --backbone Qwen/Qwen2-7B \
        --pairs data/rm_pairs.jsonl --export ckpt/rm_qwen7b/reward_model.pt
"""
import argparse
import json
import os
import random
import time

import deepspeed
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoConfig, AutoModel, AutoTokenizer
from transformers.integrations import HfDeepSpeedConfig


def build_parser():
    ap = argparse.ArgumentParser()
    ap.add_argument("--backbone", default="Qwen/Qwen2-7B")
    ap.add_argument("--pairs", required=True)
    ap.add_argument("--export", required=True)
    ap.add_argument("--ds_ckpt_dir", default="ckpt/rm_qwen7b/ds")
    ap.add_argument("--max_len", type=int, default=1536)
    ap.add_argument("--micro_batch", type=int, default=1)
    ap.add_argument("--accum", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-6)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--holdout", type=int, default=2000)
    ap.add_argument("--offload", action="store_true")
    ap.add_argument("--local_rank", type=int, default=-1)
    return ap


class Pairs(Dataset):
    def __init__(self, rows, tok, max_len):
        self.rows, self.tok, self.max_len = rows, tok, max_len

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        enc = lambda resp: self.tok(r["prompt"] + resp + self.tok.eos_token, truncation=True,
                                    max_length=self.max_len)["input_ids"]
        return enc(r["chosen"]), enc(r["rejected"])


def collate(batch, pad_id):
    seqs = [c for c, _ in batch] + [r for _, r in batch]
    L = max(map(len, seqs))
    ids = torch.full((len(seqs), L), pad_id, dtype=torch.long)
    am = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s)
        am[i, :len(s)] = 1
    return ids, am


class QwenRM(nn.Module):
    def __init__(self, name):
        super().__init__()
        self.body = AutoModel.from_pretrained(name, torch_dtype=torch.bfloat16)
        self.head = nn.Linear(self.body.config.hidden_size, 1, bias=False)

    def forward(self, ids, am):
        h = self.body(input_ids=ids, attention_mask=am, use_cache=False).last_hidden_state
        idx = am.sum(-1) - 1
        return self.head(h[torch.arange(h.size(0), device=h.device), idx]).squeeze(-1).float()


def main():
    args = build_parser().parse_args()
    deepspeed.init_distributed(dist_backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    hidden = AutoConfig.from_pretrained(args.backbone).hidden_size
    zero = {
        "stage": 3,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "stage3_max_live_parameters": 1e9,
        "reduce_bucket_size": hidden * hidden,
        "stage3_prefetch_bucket_size": int(0.9 * hidden * hidden),
        "stage3_param_persistence_threshold": 10 * hidden,
        "stage3_gather_16bit_weights_on_model_save": True,
    }
    if args.offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    ds_config = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": args.accum,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "zero_optimization": zero,
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "betas": [0.9, 0.95], "weight_decay": 0.0}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": args.lr,
                                                          "warmup_num_steps": 10, "total_num_steps": 100}},
        "wall_clock_breakdown": False,
    }
    dschf = HfDeepSpeedConfig(ds_config)  # noqa: F841  (must stay alive during from_pretrained)

    tok = AutoTokenizer.from_pretrained(args.backbone)
    tok.pad_token = tok.pad_token or "<|endoftext|>"
    with open(args.pairs) as f:
        rows = [json.loads(l) for l in f]
    random.Random(1234).shuffle(rows)  # fixed seed: identical split on every rank
    holdout, rows = rows[: args.holdout], rows[args.holdout:]
    train_ds = Pairs(rows, tok, args.max_len)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.micro_batch, sampler=sampler, drop_last=True, num_workers=2,
                        collate_fn=lambda b: collate(b, tok.pad_token_id))

    model = QwenRM(args.backbone)
    model.body.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    n_updates = max(1, args.epochs * len(loader) // args.accum)
    ds_config["scheduler"]["params"]["warmup_num_steps"] = max(1, int(0.03 * n_updates))
    ds_config["scheduler"]["params"]["total_num_steps"] = n_updates
    engine, _, _, scheduler = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                   config=ds_config)

    if rank == 0:
        print(f"world={world} pairs={len(train_ds)} holdout={len(holdout)} updates={n_updates}", flush=True)

    t0 = time.time()
    micro = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        engine.train()
        for ids, am in loader:
            r = engine(ids.to(device), am.to(device))
            rc, rr = r.chunk(2)
            loss = -F.logsigmoid(rc - rr).mean()
            engine.backward(loss)
            engine.step()
            micro += 1
            if micro % (args.accum * 10) == 0:
                l = loss.detach().clone()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"epoch {epoch} update {micro // args.accum}/{n_updates} loss {l.item():.4f} "
                          f"lr {scheduler.get_last_lr()[0]:.2e} {time.time() - t0:.0f}s", flush=True)
        engine.save_checkpoint(args.ds_ckpt_dir, tag=f"epoch{epoch}")

    # held-out accuracy; same number of forwards per rank (ZeRO-3 all-gathers inside forward)
    engine.eval()
    part = holdout[rank::world]
    n_fw = torch.tensor(len(part), device=device)
    dist.all_reduce(n_fw, op=dist.ReduceOp.MAX)
    stats = torch.zeros(2, device=device)
    with torch.no_grad():
        for i in range(int(n_fw.item())):
            row = part[i] if i < len(part) else holdout[0]
            c, rj = Pairs([row], tok, args.max_len)[0]
            ids, am = collate([(c, rj)], tok.pad_token_id)
            rc, rr = engine(ids.to(device), am.to(device)).chunk(2)
            if i < len(part):
                stats[0] += (rc > rr).float().sum()
                stats[1] += 1
    dist.all_reduce(stats)
    if rank == 0:
        print(f"holdout accuracy {(stats[0] / stats[1]).item():.4f}", flush=True)

    if rank == 0:
        os.makedirs(os.path.dirname(args.export), exist_ok=True)
        state = {k: v.detach().cpu() for k, v in engine.module.state_dict().items()}
        torch.save(state, args.export)
        tok.save_pretrained(os.path.dirname(args.export))
        print(f"exported {len(state)} tensors to {args.export}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
