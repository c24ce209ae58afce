"""Text-video retrieval on VATEX from pre-extracted CLIP ViT-L/14 frame features.

Video side: frozen per-frame CLIP features (T x 768, T varies with clip length)
-> temporal transformer -> attention pooling. Text side: DistilBERT.
Symmetric InfoNCE over the global batch.

    torchrun --nproc_per_node=8 06_vatex_feature_retrieval.py \
        --feat-dir /data/vatex/clip_l14_feats --ann-dir /data/vatex/ann
"""
import argparse
import json
import logging
import math
import os

import h5py
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModel, AutoTokenizer

log = logging.getLogger(__name__)


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--feat-dir", required=True)
    p.add_argument("--ann-dir", required=True)
    p.add_argument("--text-model", default="distilbert-base-uncased")
    p.add_argument("--max-frames", type=int, default=32)
    p.add_argument("--bs", type=int, default=128)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--temp", type=float, default=0.05)
    p.add_argument("--save-dir", default="checkpoints/vatex_tt")
    return p.parse_args()


class VatexFeats(Dataset):
    def __init__(self, feat_dir, ann_file, max_frames, train):
        self.feat_file = os.path.join(feat_dir, "feats.h5")
        with open(ann_file) as f:
            ann = json.load(f)
        # a good share of the YouTube clips are gone; keep the ones we have features for
        with h5py.File(self.feat_file, "r") as h5:
            self.ann = [a for a in ann if a["videoID"] in h5]
        self.h5 = None
        self.max_frames = max_frames
        self.train = train

    def __len__(self):
        return len(self.ann)

    def __getitem__(self, i):
        if self.h5 is None:  # open lazily, once per worker
            self.h5 = h5py.File(self.feat_file, "r")
        a = self.ann[i]
        feats = torch.from_numpy(self.h5[a["videoID"]][()]).float()
        n = feats.size(0)
        if n > self.max_frames:
            if self.train:
                start = np.random.randint(0, n - self.max_frames + 1)
                feats = feats[start:start + self.max_frames]
            else:
                feats = feats[torch.linspace(0, n - 1, self.max_frames).long()]
        caps = a["enCap"]
        cap = caps[np.random.randint(len(caps))] if self.train else caps[0]
        return feats, cap, i


class Collate:
    def __init__(self, tokenizer, max_frames):
        self.tok = tokenizer
        self.max_frames = max_frames

    def __call__(self, batch):
        feats, caps, idx = zip(*batch)
        x = torch.zeros(len(feats), self.max_frames, feats[0].size(1))
        m = torch.zeros(len(feats), self.max_frames, dtype=torch.bool)
        for j, f in enumerate(feats):
            x[j, : f.size(0)] = f
            m[j, : f.size(0)] = True
        t = self.tok(list(caps), padding=True, truncation=True, max_length=40, return_tensors="pt")
        return x, m, t["input_ids"], t["attention_mask"], torch.tensor(idx)


class GatherLayer(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        out = [torch.zeros_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(out, x)
        return tuple(out)

    @staticmethod
    def backward(ctx, *grads):
        g = torch.stack(grads)
        dist.all_reduce(g)
        return g[dist.get_rank()]


class VideoTextModel(nn.Module):
    def __init__(self, text_model, dim=512, frame_dim=768, max_frames=32):
        super().__init__()
        self.frame_proj = nn.Linear(frame_dim, dim)
        self.pos = nn.Parameter(torch.zeros(1, max_frames, dim))
        layer = nn.TransformerEncoderLayer(dim, 8, 4 * dim, 0.1, batch_first=True, norm_first=True)
        self.temporal = nn.TransformerEncoder(layer, 4)
        self.pool_q = nn.Linear(dim, 1)
        self.text = AutoModel.from_pretrained(text_model)
        self.text_proj = nn.Linear(self.text.config.hidden_size, dim)

    def video_embed(self, x, m):
        h = self.frame_proj(x) + self.pos[:, : x.size(1)]
        h = self.temporal(h, src_key_padding_mask=~m)
        w = self.pool_q(h).squeeze(-1).masked_fill(~m, -1e4).softmax(-1)
        return F.normalize((w.unsqueeze(-1) * h).sum(1), dim=-1)

    def text_embed(self, ids, att):
        h = self.text(input_ids=ids, attention_mask=att).last_hidden_state[:, 0]
        return F.normalize(self.text_proj(h), dim=-1)

    def forward(self, x, m, ids, att):
        return self.video_embed(x, m), self.text_embed(ids, att)


def info_nce(v, t, temp):
    all_v = torch.cat(GatherLayer.apply(v), 0)
    all_t = torch.cat(GatherLayer.apply(t), 0)
    target = torch.arange(v.size(0), device=v.device) + dist.get_rank() * v.size(0)
    return 0.5 * (F.cross_entropy(t @ all_v.T / temp, target) + F.cross_entropy(v @ all_t.T / temp, target))


def ranks_to_metrics(ranks):
    ranks = ranks.float() + 1
    return {"R1": 100 * (ranks <= 1).float().mean().item(), "R5": 100 * (ranks <= 5).float().mean().item(),
            "R10": 100 * (ranks <= 10).float().mean().item(), "MedR": ranks.median().item()}


@torch.no_grad()
def evaluate(net, loader, device, world):
    net.eval()
    vs, ts, ids = [], [], []
    for x, m, tok, att, idx in loader:
        v, t = net(x.to(device), m.to(device), tok.to(device), att.to(device))
        vs.append(v)
        ts.append(t)
        ids.append(idx.to(device))
    v, t, idx = torch.cat(vs), torch.cat(ts), torch.cat(ids)
    # collect the whole test set on every rank
    all_v = [torch.zeros_like(v) for _ in range(world)]
    all_t = [torch.zeros_like(t) for _ in range(world)]
    all_i = [torch.zeros_like(idx) for _ in range(world)]
    dist.all_gather(all_v, v)
    dist.all_gather(all_t, t)
    dist.all_gather(all_i, idx)
    v, t, idx = torch.cat(all_v), torch.cat(all_t), torch.cat(all_i)
    order = idx.argsort()
    v, t = v[order], t[order]
    sim = t @ v.T
    gt = torch.arange(sim.size(0), device=device)
    t2v = (sim > sim[gt, gt].unsqueeze(1)).sum(1)
    v2t = (sim.T > sim[gt, gt].unsqueeze(1)).sum(1)
    net.train()
    return ranks_to_metrics(t2v), ranks_to_metrics(v2t)


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR, format="%(asctime)s %(message)s")
    torch.manual_seed(0)
    np.random.seed(rank)

    tok = AutoTokenizer.from_pretrained(args.text_model)
    collate = Collate(tok, args.max_frames)
    train_set = VatexFeats(args.feat_dir, os.path.join(args.ann_dir, "vatex_training_v1.0.json"), args.max_frames, True)
    test_set = VatexFeats(args.feat_dir, os.path.join(args.ann_dir, "vatex_public_test.json"), args.max_frames, False)
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.bs, sampler=sampler, num_workers=8,
                              collate_fn=collate, pin_memory=True, drop_last=True)
    # strided split of the test set, every clip seen exactly once
    test_part = Subset(test_set, list(range(rank, len(test_set), world)))
    test_loader = DataLoader(test_part, batch_size=256, num_workers=4, collate_fn=collate)

    model = VideoTextModel(args.text_model, max_frames=args.max_frames).to(device)
    model = DDP(model, device_ids=[local_rank])
    decay = [p for n, p in model.named_parameters() if p.ndim > 1 and "pos" not in n]
    no_decay = [p for n, p in model.named_parameters() if p.ndim <= 1 or "pos" in n]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr)
    total = args.epochs * len(train_loader)
    warm = len(train_loader)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / (total - warm))))

    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)
    best = -1.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for it, (x, m, ids, att, _) in enumerate(train_loader):
            x, m = x.to(device, non_blocking=True), m.to(device, non_blocking=True)
            ids, att = ids.to(device, non_blocking=True), att.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                v, t = model(x, m, ids, att)
            loss = info_nce(v.float(), t.float(), args.temp)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            if it % 100 == 0:
                log.info("epoch %d it %d/%d loss %.4f", epoch, it, len(train_loader), loss.item())

        t2v, v2t = evaluate(model.module, test_loader, device, world)
        log.info("epoch %d  t2v %s  v2t %s", epoch, t2v, v2t)
        if rank == 0:
            torch.save({"model": model.module.state_dict(), "epoch": epoch, "t2v": t2v},
                       os.path.join(args.save_dir, "last.pth"))
            if t2v["R1"] > best:
                best = t2v["R1"]
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "t2v": t2v},
                           os.path.join(args.save_dir, "best.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
