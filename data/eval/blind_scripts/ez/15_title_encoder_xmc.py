#!/usr/bin/env python
"""Renee-style end-to-end XMC: DistilBERT title encoder + a full 1.3M-way sigmoid
output layer (no shortlist), bf16, with the best epoch re-loaded at the end for the
final test report.

    torchrun --nproc_per_node=8 15_title_encoder_xmc.py \
        --data-dir /mnt/shared/xmc/lf_amazontitles_1.3m_tok \
        --encoder /mnt/shared/models/distilbert-base-uncased --out /mnt/shared/xmc/runs/renee
"""
import argparse
import json
import math
import os
import time

import numpy as np
import scipy.sparse as sp
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModel, get_cosine_schedule_with_warmup


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-dir", required=True)
    ap.add_argument("--encoder", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--max-len", type=int, default=32)
    ap.add_argument("--global-batch-size", type=int, default=1024)
    ap.add_argument("--lr-enc", type=float, default=1e-4)
    ap.add_argument("--lr-clf", type=float, default=5e-3)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--warmup-ratio", type=float, default=0.02)
    ap.add_argument("--eval-every", type=int, default=3)
    return ap.parse_args()


class TokDocs(Dataset):
    def __init__(self, ids, Y, rows=None):
        self.ids, self.Y = ids, Y
        self.rows = np.arange(ids.shape[0]) if rows is None else rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        return torch.from_numpy(self.ids[r].astype(np.int64)), int(r)


class ProductTagger(nn.Module):
    def __init__(self, encoder_path, num_labels):
        super().__init__()
        self.encoder = AutoModel.from_pretrained(encoder_path)
        hid = self.encoder.config.hidden_size
        self.dropout = nn.Dropout(0.3)
        self.clf = nn.Linear(hid, num_labels)
        nn.init.normal_(self.clf.weight, std=0.01)
        nn.init.constant_(self.clf.bias, -math.log(num_labels))

    def forward(self, ids):
        mask = (ids != 0).long()
        h = self.encoder(input_ids=ids, attention_mask=mask).last_hidden_state
        h = (h * mask.unsqueeze(-1)).sum(1) / mask.sum(1, keepdim=True)
        return self.clf(self.dropout(h))


def target_matrix(Y, rows, device):
    sub = Y[rows]
    t = torch.zeros(len(rows), Y.shape[1], device=device, dtype=torch.bfloat16)
    r = torch.from_numpy(np.repeat(np.arange(len(rows)), np.diff(sub.indptr))).to(device)
    t[r, torch.from_numpy(sub.indices.astype(np.int64)).to(device)] = 1
    return t


@torch.no_grad()
def evaluate(net, loader, Y, device, ks=(1, 3, 5)):
    net.eval()
    disc = 1.0 / np.log2(np.arange(2, max(ks) + 2))
    sums = np.zeros(2 * len(ks) + 1)
    for ids, rows in loader:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            top = net(ids.to(device)).topk(max(ks), dim=1).indices.cpu().numpy()
        for r, pred in zip(rows.numpy(), top):
            true = Y.indices[Y.indptr[r]:Y.indptr[r + 1]]
            hit = np.isin(pred, true)
            for j, k in enumerate(ks):
                sums[j] += hit[:k].sum() / k
                if len(true):
                    sums[len(ks) + j] += (hit[:k] * disc[:k]).sum() / disc[: min(k, len(true))].sum()
        sums[-1] += len(rows)
    t = torch.from_numpy(sums).to(device)
    dist.all_reduce(t)
    net.train()
    t = (t[:-1] / t[-1]).tolist()
    return {**{f"P@{k}": t[j] for j, k in enumerate(ks)},
            **{f"nDCG@{k}": t[len(ks) + j] for j, k in enumerate(ks)}}


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1)

    ids_tr = np.load(os.path.join(args.data_dir, f"trn_ids_{args.max_len}.npy"), mmap_mode="r")
    ids_te = np.load(os.path.join(args.data_dir, f"tst_ids_{args.max_len}.npy"), mmap_mode="r")
    Y_tr = sp.load_npz(os.path.join(args.data_dir, "Y_trn.npz")).tocsr()
    Y_te = sp.load_npz(os.path.join(args.data_dir, "Y_tst.npz")).tocsr()
    num_labels = Y_tr.shape[1]

    train_ds = TokDocs(ids_tr, Y_tr)
    test_ds = TokDocs(ids_te, Y_te, rows=np.arange(rank, ids_te.shape[0], world))
    sampler = DistributedSampler(train_ds, shuffle=True, seed=1, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.global_batch_size // world, sampler=sampler,
                              num_workers=4, pin_memory=True, drop_last=True)
    test_loader = DataLoader(test_ds, batch_size=512, num_workers=2)

    net = ProductTagger(args.encoder, num_labels).to(device)
    model = DDP(net, device_ids=[local_rank], gradient_as_bucket_view=True)
    opt = torch.optim.AdamW([
        {"params": net.encoder.parameters(), "lr": args.lr_enc, "weight_decay": 0.01},
        {"params": net.clf.parameters(), "lr": args.lr_clf, "weight_decay": 0.0},
    ])
    total = args.epochs * len(train_loader)
    sched = get_cosine_schedule_with_warmup(opt, int(args.warmup_ratio * total), total)
    best_path = os.path.join(args.out, "best.pt")
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    best = -1.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for step, (ids, rows) in enumerate(train_loader):
            ids = ids.to(device, non_blocking=True)
            y = target_matrix(Y_tr, np.sort(rows.numpy()), device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(ids)
                loss = F.binary_cross_entropy_with_logits(logits, y, reduction="sum") / ids.size(0)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            if rank == 0 and step % 200 == 0:
                print(f"epoch {epoch} step {step} loss {loss.item():.3f} ({time.time() - t0:.0f}s)",
                      flush=True)

        if (epoch + 1) % args.eval_every == 0:
            res = evaluate(net, test_loader, Y_te, device)
            if rank == 0:
                print(f"epoch {epoch} " + " ".join(f"{k}={v:.4f}" for k, v in res.items()), flush=True)
                if res["P@1"] > best:
                    best = res["P@1"]
                    torch.save({"model": model.state_dict(), "epoch": epoch, "res": res}, best_path)
            dist.barrier()

    # final report with the best checkpoint
    final = ProductTagger(args.encoder, num_labels)
    ckpt = torch.load(best_path, map_location="cpu")
    final.load_state_dict(ckpt["model"])
    final.to(device)
    res = evaluate(final, test_loader, Y_te, device)
    if rank == 0:
        print(f"best epoch {ckpt['epoch']}: " + json.dumps(res), flush=True)
        with open(os.path.join(args.out, "final_metrics.json"), "w") as f:
            json.dump({"epoch": ckpt["epoch"], **res}, f, indent=2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
