#!/usr/bin/env python3
# Reward model training for the RLHF pipeline (stage 2 of 3: sft -> rm -> ppo).
#
# torchrun --standalone --nproc_per_node=8 05_rm_ultrafeedback.py \
#     --base ckpt/sft-qwen2.5-0.5b --data data/ultrafeedback_binarized --out ckpt/rm-qwen0.5b
import argparse
import logging
import math
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from datasets import load_from_disk
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModel, AutoTokenizer

log = logging.getLogger(__name__)


class ScalarHeadRM(nn.Module):
    def __init__(self, base_path):
        super().__init__()
        self.transformer = AutoModel.from_pretrained(base_path, torch_dtype=torch.bfloat16)
        hidden = self.transformer.config.hidden_size
        self.head = nn.Sequential(nn.Dropout(0.0), nn.Linear(hidden, 1))

    def forward(self, input_ids, attention_mask):
        out = self.transformer(input_ids=input_ids, attention_mask=attention_mask)
        h = out.last_hidden_state
        idx = attention_mask.sum(-1) - 1
        h_last = h[torch.arange(h.size(0), device=h.device), idx]
        return self.head(h_last.float()).squeeze(-1)


def build_datasets(data_dir, tokenizer, max_len):
    ds = load_from_disk(data_dir)

    def encode(ex):
        chosen = tokenizer.apply_chat_template(ex["chosen"], tokenize=False)
        rejected = tokenizer.apply_chat_template(ex["rejected"], tokenize=False)
        c = tokenizer(chosen, truncation=True, max_length=max_len, add_special_tokens=False)
        r = tokenizer(rejected, truncation=True, max_length=max_len, add_special_tokens=False)
        return {"chosen_ids": c["input_ids"], "rejected_ids": r["input_ids"]}

    cols = ds["train_prefs"].column_names
    train = ds["train_prefs"].map(encode, remove_columns=cols, num_proc=8)
    test = ds["test_prefs"].map(encode, remove_columns=cols, num_proc=8)
    return train, test


class PairCollator:
    def __init__(self, pad_id):
        self.pad_id = pad_id

    def __call__(self, feats):
        seqs = [f["chosen_ids"] for f in feats] + [f["rejected_ids"] for f in feats]
        n, L = len(seqs), max(len(s) for s in seqs)
        ids = torch.full((n, L), self.pad_id, dtype=torch.long)
        mask = torch.zeros((n, L), dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = torch.tensor(s)
            mask[i, : len(s)] = 1
        return {"input_ids": ids, "attention_mask": mask}


@torch.no_grad()
def run_eval(model, loader, device):
    model.eval()
    n_correct, n_total, loss_sum = 0, 0, 0.0
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        rewards = model(**batch)
        rc, rr = rewards.chunk(2)
        loss_sum += -F.logsigmoid(rc - rr).sum().item()
        n_correct += (rc > rr).sum().item()
        n_total += rc.numel()
    model.train()
    return {"accuracy": n_correct / max(n_total, 1), "loss": loss_sum / max(n_total, 1)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--max_len", type=int, default=1024)
    ap.add_argument("--per_device_batch", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--lr", type=float, default=5e-6)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--eval_steps", type=int, default=500)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    logging.basicConfig(
        stream=sys.stdout,
        level=logging.INFO if rank == 0 else logging.ERROR,
        format="%(asctime)s %(levelname)s %(message)s",
    )

    tokenizer = AutoTokenizer.from_pretrained(args.base)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token

    # datasets.map caches by fingerprint; let rank 0 fill the cache first
    if rank != 0:
        dist.barrier()
    train_ds, test_ds = build_datasets(args.data, tokenizer, args.max_len)
    if rank == 0:
        dist.barrier()

    collator = PairCollator(tokenizer.pad_token_id)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    test_sampler = DistributedSampler(test_ds, shuffle=False)
    train_loader = DataLoader(train_ds, batch_size=args.per_device_batch, sampler=train_sampler,
                              collate_fn=collator, num_workers=4, pin_memory=True, drop_last=True)
    test_loader = DataLoader(test_ds, batch_size=args.per_device_batch * 2, sampler=test_sampler,
                             collate_fn=collator, num_workers=2)

    model = ScalarHeadRM(args.base).to(device)
    model = DDP(model, device_ids=[local_rank])

    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total = args.epochs * len(train_loader)

    def lr_at(step):
        if step < args.warmup:
            return (step + 1) / args.warmup
        progress = (step - args.warmup) / max(1, total - args.warmup)
        return 0.5 * (1 + math.cos(math.pi * progress))

    sched = torch.optim.lr_scheduler.LambdaLR(optim, lr_at)
    log.info("world_size=%d train=%d test=%d total_steps=%d", world_size, len(train_ds), len(test_ds), total)

    best_acc = 0.0
    step = 0
    tic = time.time()
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        for batch in train_loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            rewards = model(**batch)
            rc, rr = rewards.chunk(2)
            loss = -F.logsigmoid(rc - rr).mean()
            loss.backward()
            grad_norm = nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optim.step()
            sched.step()
            optim.zero_grad(set_to_none=True)
            step += 1

            if step % 25 == 0:
                t = torch.stack([loss.detach(), (rc > rr).float().mean()])
                dist.all_reduce(t, op=dist.ReduceOp.AVG)
                log.info("epoch %d step %d/%d loss %.4f acc %.3f gnorm %.2f lr %.2e (%.1f it/s)",
                         epoch, step, total, t[0].item(), t[1].item(), grad_norm.item(),
                         sched.get_last_lr()[0], 25 / (time.time() - tic))
                tic = time.time()

            if step % args.eval_steps == 0 or step == total:
                metrics = run_eval(model.module, test_loader, device)
                log.info("eval step %d accuracy %.4f loss %.4f", step, metrics["accuracy"], metrics["loss"])
                if rank == 0 and metrics["accuracy"] > best_acc:
                    best_acc = metrics["accuracy"]
                    os.makedirs(args.out, exist_ok=True)
                    torch.save(model.module.state_dict(), os.path.join(args.out, "reward_model.pt"))
                    tokenizer.save_pretrained(args.out)
                    log.info("new best %.4f saved to %s", best_acc, args.out)
                dist.barrier()

    log.info("finished, best eval accuracy %.4f", best_acc)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
