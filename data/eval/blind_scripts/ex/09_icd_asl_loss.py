#!/usr/bin/env python
# Multi-label ICD-9 coding (MIMIC-III full, ~8.9k codes) with a chunked clinical BERT and the
# asymmetric loss (Ridnik et al. 2021) to cope with the extreme label imbalance.
# Documents are split into overlapping 512-token windows; window [CLS] vectors are attended per label.
#
#   torchrun --nproc_per_node=4 09_icd_asl_loss.py --data_dir /data/mimic3_full --wandb_project icd-asl

import argparse
import os
import pickle
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import wandb
from sklearn.metrics import f1_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModel, get_linear_schedule_with_warmup


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data_dir", required=True, help="pre-tokenised windows from tokenize_mimic.py")
    p.add_argument("--encoder", default="emilyalsentzer/Bio_ClinicalBERT")
    p.add_argument("--max_windows", type=int, default=16)
    p.add_argument("--batch_size", type=int, default=4)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--head_lr", type=float, default=5e-4)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--gamma_neg", type=float, default=4.0)
    p.add_argument("--gamma_pos", type=float, default=0.0)
    p.add_argument("--clip", type=float, default=0.05)
    p.add_argument("--threshold", type=float, default=0.5)
    p.add_argument("--wandb_project", default="icd-coding")
    p.add_argument("--run_name", default=None)
    p.add_argument("--save_dir", default="checkpoints/asl_full")
    p.add_argument("--seed", type=int, default=3)
    return p.parse_args()


class AsymmetricLoss(nn.Module):
    def __init__(self, gamma_neg=4.0, gamma_pos=0.0, clip=0.05, eps=1e-8):
        super().__init__()
        self.gamma_neg, self.gamma_pos, self.clip, self.eps = gamma_neg, gamma_pos, clip, eps

    def forward(self, logits, y):
        p = torch.sigmoid(logits)
        p_neg = 1 - p
        if self.clip > 0:
            p_neg = (p_neg + self.clip).clamp(max=1)
        loss = y * torch.log(p.clamp(min=self.eps)) + (1 - y) * torch.log(p_neg.clamp(min=self.eps))
        with torch.no_grad():
            pt = p * y + p_neg * (1 - y)
            w = torch.pow(1 - pt, self.gamma_pos * y + self.gamma_neg * (1 - y))
        return -(loss * w).sum() / logits.size(0)


class WindowedNotes(Dataset):
    def __init__(self, path, num_codes, max_windows):
        with open(path, "rb") as f:
            self.docs = pickle.load(f)  # list of dicts: windows (n x 512 int32), codes (list[int])
        self.num_codes, self.max_windows = num_codes, max_windows

    def __len__(self):
        return len(self.docs)

    def __getitem__(self, i):
        d = self.docs[i]
        w = torch.as_tensor(d["windows"][: self.max_windows], dtype=torch.long)
        ids = torch.zeros(self.max_windows, w.size(1), dtype=torch.long)
        ids[: w.size(0)] = w
        win_mask = torch.zeros(self.max_windows, dtype=torch.bool)
        win_mask[: w.size(0)] = True
        y = torch.zeros(self.num_codes)
        y[d["codes"]] = 1.0
        return ids, win_mask, y


class WindowLabelAttention(nn.Module):
    def __init__(self, encoder, num_codes):
        super().__init__()
        self.bert = AutoModel.from_pretrained(encoder, add_pooling_layer=False)
        h = self.bert.config.hidden_size
        self.query = nn.Linear(h, num_codes, bias=False)
        self.out = nn.Parameter(torch.empty(num_codes, h))
        self.bias = nn.Parameter(torch.zeros(num_codes))
        nn.init.xavier_uniform_(self.out)

    def forward(self, ids, win_mask):
        b, w, t = ids.shape
        flat = ids.view(b * w, t)
        keep = win_mask.view(-1)
        cls = torch.zeros(b * w, self.bert.config.hidden_size, device=ids.device, dtype=torch.float)
        out = self.bert(input_ids=flat[keep], attention_mask=(flat[keep] != 0).long()).last_hidden_state[:, 0]
        cls[keep] = out.float()
        cls = cls.view(b, w, -1)
        scores = self.query(cls).transpose(1, 2).masked_fill(~win_mask[:, None, :], -1e4)  # b x L x w
        ctx = torch.softmax(scores, -1) @ cls                                             # b x L x h
        return (ctx * self.out).sum(-1) + self.bias


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    probs, golds = [], []
    for ids, win_mask, y in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            logits = model(ids.to(device), win_mask.to(device))
        probs.append(torch.sigmoid(logits.float()).cpu().numpy().astype(np.float16))
        golds.append(y.numpy().astype(np.uint8))
    shards = [None] * dist.get_world_size()
    dist.all_gather_object(shards, (np.concatenate(probs), np.concatenate(golds)))
    return np.concatenate([s[0] for s in shards]), np.concatenate([s[1] for s in shards])


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    wandb.init(project=args.wandb_project, name=args.run_name, config=vars(args))

    with open(os.path.join(args.data_dir, "codes.txt")) as f:
        codes = [l.strip() for l in f if l.strip()]
    train = WindowedNotes(os.path.join(args.data_dir, "train_windows.pkl"), len(codes), args.max_windows)
    dev = WindowedNotes(os.path.join(args.data_dir, "dev_windows.pkl"), len(codes), args.max_windows)
    sampler = DistributedSampler(train, shuffle=True, seed=args.seed)
    train_dl = DataLoader(train, batch_size=args.batch_size, sampler=sampler, num_workers=6,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    dev_dl = DataLoader(Subset(dev, range(rank, len(dev), world)), batch_size=8, num_workers=4)

    model = WindowLabelAttention(args.encoder, len(codes)).to(device)
    model = DDP(model, device_ids=[local_rank])
    enc_params = [p for n, p in model.module.named_parameters() if n.startswith("bert.")]
    head_params = [p for n, p in model.module.named_parameters() if not n.startswith("bert.")]
    opt = torch.optim.AdamW([{"params": enc_params, "lr": args.lr},
                             {"params": head_params, "lr": args.head_lr}], weight_decay=0.01)
    total = len(train_dl) * args.epochs
    sched = get_linear_schedule_with_warmup(opt, int(0.1 * total), total)
    scaler = torch.cuda.amp.GradScaler()
    criterion = AsymmetricLoss(args.gamma_neg, args.gamma_pos, args.clip)

    best_micro = 0.0
    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for ids, win_mask, y in train_dl:
            ids, win_mask, y = ids.to(device, non_blocking=True), win_mask.to(device), y.to(device)
            with torch.autocast("cuda", dtype=torch.float16):
                logits = model(ids, win_mask)
            loss = criterion(logits.float(), y)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            sched.step()
            step += 1
            if rank == 0 and step % 50 == 0:
                wandb.log({"train/loss": loss.item(), "train/grad_norm": gnorm.item(),
                           "train/lr": sched.get_last_lr()[0], "epoch": epoch}, step=step)

        probs, golds = evaluate(model.module, dev_dl, device)
        if rank == 0:
            preds = probs >= args.threshold
            micro = f1_score(golds, preds, average="micro", zero_division=0)
            macro = f1_score(golds, preds, average="macro", zero_division=0)
            wandb.log({"dev/micro_f1": micro, "dev/macro_f1": macro,
                       "epoch_time_s": time.time() - t0}, step=step)
            print(f"epoch {epoch}: micro-F1 {micro:.4f} macro-F1 {macro:.4f}", flush=True)
            if micro > best_micro:
                best_micro = micro
                os.makedirs(args.save_dir, exist_ok=True)
                torch.save({"state_dict": model.module.state_dict(), "codes": codes, "epoch": epoch},
                           os.path.join(args.save_dir, "best.pt"))
                wandb.run.summary["best_micro_f1"] = best_micro
        dist.barrier()

    if rank == 0:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
