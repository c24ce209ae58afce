#!/usr/bin/env python
# Dual-encoder video-text pre-training on WebVid-2M, zero-shot eval on MSR-VTT 1k-A.
# Video: timm ViT-B/16 (ImageNet-21k init) applied per frame + temporal attention pooling.
# Text: DistilBERT. Variable number of frames per clip is handled with a frame mask.
#
#   torchrun --nproc_per_node=8 15_webvid_dual_encoder.py --webvid /data/webvid --msrvtt /data/msrvtt
import argparse
import csv
import json
import os
import random
import time

import decord
import numpy as np
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import DistilBertModel, DistilBertTokenizerFast

decord.bridge.set_bridge("torch")
IMNET_MEAN = torch.tensor([0.5, 0.5, 0.5]).view(3, 1, 1, 1)
IMNET_STD = torch.tensor([0.5, 0.5, 0.5]).view(3, 1, 1, 1)


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--webvid", required=True)
    p.add_argument("--msrvtt", required=True)
    p.add_argument("--num-frames", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=24)
    p.add_argument("--lr", type=float, default=3e-5)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--eval-every", type=int, default=2000)
    p.add_argument("--out", default="output/webvid_dual")
    return p.parse_args()


def read_clip(path, n, train, size=224):
    vr = decord.VideoReader(path, width=size, height=size, num_threads=1)
    total = len(vr)
    k = min(n, total)
    edges = np.linspace(0, total, k + 1).astype(int)
    if train:
        idx = [np.random.randint(a, max(a + 1, b)) for a, b in zip(edges[:-1], edges[1:])]
    else:
        idx = ((edges[:-1] + edges[1:]) // 2).tolist()
    x = vr.get_batch(idx).permute(3, 0, 1, 2).float() / 255.0  # C, k, H, W
    x = (x - IMNET_MEAN) / IMNET_STD
    out = torch.zeros(3, n, size, size)
    out[:, :k] = x
    mask = torch.zeros(n, dtype=torch.bool)
    mask[:k] = True
    return out, mask


class WebVid(Dataset):
    def __init__(self, root, n_frames):
        with open(os.path.join(root, "results_2M_train.csv")) as f:
            rows = list(csv.DictReader(f))
        self.items = [(os.path.join(root, "videos", r["page_dir"], r["videoid"] + ".mp4"), r["name"]) for r in rows]
        self.n = n_frames

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        path, caption = self.items[i]
        try:
            x, m = read_clip(path, self.n, train=True)
        except Exception:  # a few hundred broken downloads
            return self[random.randrange(len(self))]
        return x, m, caption


class MSRVTT1kA(Dataset):
    def __init__(self, root, n_frames):
        with open(os.path.join(root, "annotation", "MSRVTT_JSFUSION_test.json")) as f:
            self.items = json.load(f)
        self.root, self.n = root, n_frames

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        it = self.items[i]
        x, m = read_clip(os.path.join(self.root, "videos", it["video_id"] + ".mp4"), self.n, train=False)
        return x, m, it["sentence"]


class DualEncoder(nn.Module):
    def __init__(self, dim=256):
        super().__init__()
        self.vit = timm.create_model("vit_base_patch16_224.augreg_in21k", pretrained=True, num_classes=0)
        self.temporal_q = nn.Parameter(torch.randn(1, 1, 768) * 0.02)
        self.temporal_attn = nn.MultiheadAttention(768, 12, batch_first=True)
        self.frame_pos = nn.Parameter(torch.zeros(1, 32, 768))
        self.bert = DistilBertModel.from_pretrained("distilbert-base-uncased")
        self.v_head = nn.Linear(768, dim)
        self.t_head = nn.Linear(768, dim)
        self.temp = nn.Parameter(torch.tensor(0.05))

    def encode_video(self, x, mask):
        b, c, t, h, w = x.shape
        f = self.vit(x.transpose(1, 2).reshape(b * t, c, h, w)).view(b, t, -1) + self.frame_pos[:, :t]
        pooled, _ = self.temporal_attn(self.temporal_q.expand(b, -1, -1), f, f, key_padding_mask=~mask)
        return F.normalize(self.v_head(pooled.squeeze(1)), dim=-1)

    def encode_text(self, ids, att):
        h = self.bert(input_ids=ids, attention_mask=att).last_hidden_state[:, 0]
        return F.normalize(self.t_head(h), dim=-1)

    def forward(self, x, mask, ids, att):
        return self.encode_video(x, mask), self.encode_text(ids, att), self.temp.clamp(min=0.01)


def all_gather_grad(x):
    xs = [torch.zeros_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(xs, x)
    xs[dist.get_rank()] = x
    return torch.cat(xs)


@torch.no_grad()
def evaluate(model, loader, tokenizer, device):
    model.eval()
    V, T = [], []
    for x, m, caps in loader:
        tok = tokenizer(list(caps), padding=True, truncation=True, max_length=32, return_tensors="pt").to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            V.append(model.encode_video(x.to(device), m.to(device)).float())
            T.append(model.encode_text(tok.input_ids, tok.attention_mask).float())
    sim = torch.cat(T) @ torch.cat(V).t()
    ranks = (sim > sim.diag()[:, None]).sum(1) + 1
    model.train()
    return {"R@1": (ranks <= 1).float().mean().item() * 100, "R@5": (ranks <= 5).float().mean().item() * 100,
            "R@10": (ranks <= 10).float().mean().item() * 100, "MedR": ranks.float().median().item()}


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)
    np.random.seed(rank)
    random.seed(rank)

    tokenizer = DistilBertTokenizerFast.from_pretrained("distilbert-base-uncased")
    train_set = WebVid(args.webvid, args.num_frames)
    test_set = MSRVTT1kA(args.msrvtt, args.num_frames)
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, args.batch_size, sampler=sampler, num_workers=12, pin_memory=True,
                              drop_last=True, persistent_workers=True, prefetch_factor=4)
    test_loader = DataLoader(test_set, 32, shuffle=False, num_workers=8)

    model = DDP(DualEncoder().to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    total = args.epochs * len(train_loader)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=total, pct_start=0.05)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    step, best = 0, 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for x, m, caps in train_loader:
            tok = tokenizer(list(caps), padding="max_length", truncation=True, max_length=32, return_tensors="pt")
            x, m = x.to(device, non_blocking=True), m.to(device, non_blocking=True)
            ids, att = tok.input_ids.to(device), tok.attention_mask.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                v, t, temp = model(x, m, ids, att)
            v, t = all_gather_grad(v.float()), all_gather_grad(t.float())
            logits = t @ v.t() / temp.float()
            target = torch.arange(logits.size(0), device=device)
            loss = (F.cross_entropy(logits, target) + F.cross_entropy(logits.t(), target)) / 2
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1
            if rank == 0 and step % 50 == 0:
                print(f"ep {epoch} step {step} loss {loss.item():.4f} temp {temp.item():.4f} "
                      f"{(time.time() - t0) / 50:.2f}s/it", flush=True)
                t0 = time.time()

            if step % args.eval_every == 0:
                if rank == 0:
                    res = evaluate(model, test_loader, tokenizer, device)
                    print(f"step {step} MSR-VTT zero-shot t2v {res}", flush=True)
                    torch.save({"model": model.module.state_dict(), "step": step}, os.path.join(args.out, "last.pt"))
                    if res["R@1"] > best:
                        best = res["R@1"]
                        torch.save({"model": model.module.state_dict(), "step": step}, os.path.join(args.out, "best.pt"))
                dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
