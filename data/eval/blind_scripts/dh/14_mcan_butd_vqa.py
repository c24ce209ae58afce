"""MCAN-small on VQAv2 with bottom-up (Faster R-CNN, 36 boxes) region features.

Features: trainval_36.h5 (image_id -> [36, 2048] feats, [36, 4] boxes)
Answers: the standard 3129-answer list + soft scores from prepro_vqa.py.

torchrun --nproc_per_node=4 14_mcan_butd_vqa.py --feat_h5 /data/butd/trainval_36.h5 --prepro /data/vqa/prepro
"""
import argparse
import json
import math
import os
from collections import defaultdict

import h5py
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--feat_h5", required=True)
    p.add_argument("--prepro", required=True)
    p.add_argument("--glove", default="/data/glove/glove.840B.300d.npy")
    p.add_argument("--out", default="ckpts/mcan_small")
    p.add_argument("--local_rank", type=int, default=0)
    p.add_argument("--batch_size", type=int, default=64)
    p.add_argument("--epochs", type=int, default=13)
    p.add_argument("--base_lr", type=float, default=1e-4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=6)
    return p.parse_args()


class BUTDVQA(Dataset):
    def __init__(self, qa_json, feat_h5, max_q=14):
        self.qa = json.load(open(qa_json))
        self.feat_h5, self.max_q = feat_h5, max_q
        self.h5 = None
        with h5py.File(feat_h5, "r") as f:
            self.img2row = {int(i): r for r, i in enumerate(f["image_ids"][:])}
        self.n_answers = self.qa["num_answers"]

    def __len__(self):
        return len(self.qa["questions"])

    def __getitem__(self, i):
        if self.h5 is None:
            self.h5 = h5py.File(self.feat_h5, "r")
        q = self.qa["questions"][i]
        row = self.img2row[q["image_id"]]
        feats = torch.from_numpy(self.h5["features"][row]).float()
        boxes = torch.from_numpy(self.h5["boxes"][row]).float()
        toks = q["tokens"][: self.max_q]
        toks = torch.tensor(toks + [0] * (self.max_q - len(toks)))
        target = torch.zeros(self.n_answers)
        for a, s in zip(q["answer_ids"], q["answer_scores"]):
            target[a] = s
        return feats, boxes, toks, target, q["question_id"]


class MHAtt(nn.Module):
    def __init__(self, d, heads=8, drop=0.1):
        super().__init__()
        self.att = nn.MultiheadAttention(d, heads, dropout=drop, batch_first=True)
        self.ffn = nn.Sequential(nn.Linear(d, 4 * d), nn.ReLU(inplace=True), nn.Dropout(drop), nn.Linear(4 * d, d))
        self.n1, self.n2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.drop = nn.Dropout(drop)

    def forward(self, x, y, y_mask):
        x = self.n1(x + self.drop(self.att(x, y, y, key_padding_mask=y_mask, need_weights=False)[0]))
        return self.n2(x + self.drop(self.ffn(x)))


class SGA(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.self_att = MHAtt(d)
        self.guided = MHAtt(d)

    def forward(self, x, x_mask, y, y_mask):
        return self.guided(self.self_att(x, x, x_mask), y, y_mask)


class AttFlat(nn.Module):
    def __init__(self, d, out):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(d, d), nn.ReLU(inplace=True), nn.Dropout(0.1), nn.Linear(d, 1))
        self.proj = nn.Linear(d, out)

    def forward(self, x, mask):
        w = self.mlp(x).masked_fill(mask.unsqueeze(2), -1e9).softmax(1)
        return self.proj((w * x).sum(1))


class MCAN(nn.Module):
    def __init__(self, glove, n_answers, d=512, layers=6):
        super().__init__()
        self.embed = nn.Embedding.from_pretrained(torch.from_numpy(glove).float(), freeze=False, padding_idx=0)
        self.lstm = nn.LSTM(300, d, batch_first=True)
        self.img_proj = nn.Linear(2048 + 5, d)
        self.enc = nn.ModuleList(MHAtt(d) for _ in range(layers))
        self.dec = nn.ModuleList(SGA(d) for _ in range(layers))
        self.flat_q, self.flat_v = AttFlat(d, 2 * d), AttFlat(d, 2 * d)
        self.norm = nn.LayerNorm(2 * d)
        self.cls = nn.Linear(2 * d, n_answers)

    def forward(self, feats, boxes, q):
        q_mask = q == 0
        v_mask = feats.abs().sum(-1) == 0
        area = ((boxes[..., 2] - boxes[..., 0]) * (boxes[..., 3] - boxes[..., 1])).unsqueeze(-1)
        v = self.img_proj(torch.cat([feats, boxes, area], -1))
        x, _ = self.lstm(self.embed(q))
        for layer in self.enc:
            x = layer(x, x, q_mask)
        for layer in self.dec:
            v = layer(v, v_mask, x, q_mask)
        return self.cls(self.norm(self.flat_q(x, q_mask) + self.flat_v(v, v_mask)))


def lr_at(epoch, base):
    # MCAN schedule: warmup over 3 epochs, decay x0.2 at epochs 10 and 12
    if epoch < 3:
        return base * (epoch + 1) / 4
    return base * (0.2 ** sum(epoch >= m for m in (10, 12)))


def vqa_acc(pred_idx, answers, label2ans):
    pred = label2ans[pred_idx]
    return float(np.mean([min(1.0, sum(a == pred for j, a in enumerate(answers) if j != i) / 3.0)
                          for i in range(len(answers))]))


def main():
    args = get_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", args.local_rank)

    label2ans = json.load(open(os.path.join(args.prepro, "label2ans.json")))
    val_meta = {m["question_id"]: m for m in json.load(open(os.path.join(args.prepro, "val_meta.json")))}
    train_set = BUTDVQA(os.path.join(args.prepro, "train_qa.json"), args.feat_h5)
    val_set = BUTDVQA(os.path.join(args.prepro, "val_qa.json"), args.feat_h5)
    train_sampler = DistributedSampler(train_set, shuffle=True)
    train_loader = DataLoader(train_set, args.batch_size, sampler=train_sampler, num_workers=8,
                              pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, 256, sampler=DistributedSampler(val_set, shuffle=False),
                            num_workers=8, pin_memory=True)

    model = MCAN(np.load(args.glove), len(label2ans), args.hidden, args.layers).to(device)
    model = DDP(model, device_ids=[args.local_rank], output_device=args.local_rank)
    # base_lr is per 64 samples; scale with the global batch
    peak_lr = args.base_lr * args.batch_size * world / 64
    optimizer = torch.optim.Adam(model.parameters(), lr=peak_lr, betas=(0.9, 0.98), eps=1e-9)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        for g in optimizer.param_groups:
            g["lr"] = lr_at(epoch, peak_lr)
        model.train()
        loss_sum = torch.zeros(2, device=device)
        for it, (feats, boxes, q, target, _) in enumerate(train_loader):
            feats, boxes, q, target = (t.to(device, non_blocking=True) for t in (feats, boxes, q, target))
            logits = model(feats, boxes, q)
            loss = F.binary_cross_entropy_with_logits(logits, target, reduction="sum") / feats.size(0)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            loss_sum += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(loss_sum)
        if rank == 0:
            print(f"epoch {epoch} lr {lr_at(epoch, peak_lr):.2e} train loss {(loss_sum[0] / loss_sum[1]).item():.4f}",
                  flush=True)

        model.eval()
        local = {}
        with torch.no_grad():
            for feats, boxes, q, _, qids in val_loader:
                logits = model.module(feats.to(device), boxes.to(device), q.to(device))
                local.update(zip(qids.tolist(), logits.argmax(1).tolist()))
        parts = [None] * world
        dist.all_gather_object(parts, local)
        if rank == 0:
            preds = {k: v for p in parts for k, v in p.items()}
            by_type, by_qtype, overall = defaultdict(list), defaultdict(list), []
            for qid, p in preds.items():
                m = val_meta[qid]
                a = vqa_acc(p, m["answers"], label2ans)
                overall.append(a)
                by_type[m["answer_type"]].append(a)
                by_qtype[m["question_type"]].append(a)
            res = {"overall": 100 * np.mean(overall), **{k: 100 * np.mean(v) for k, v in by_type.items()}}
            print(f"epoch {epoch} val: " + ", ".join(f"{k} {v:.2f}" for k, v in res.items()), flush=True)
            with open(os.path.join(args.out, f"qtype_epoch{epoch}.json"), "w") as f:
                json.dump({k: 100 * np.mean(v) for k, v in sorted(by_qtype.items())}, f, indent=1)
            torch.save({"state_dict": model.module.state_dict(), "epoch": epoch, "optimizer": optimizer.state_dict()},
                       os.path.join(args.out, f"epoch{epoch}.pkl"))
            if res["overall"] > best:
                best = res["overall"]
                torch.save({"state_dict": model.module.state_dict(), "epoch": epoch}, os.path.join(args.out, "best.pkl"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
