#!/usr/bin/env python
"""HuBERT pretraining + feature dumping for the next k-means round.

  train:  torchrun --nproc_per_node 8 10_hubert_train_and_dump.py train --data D --labels L --exp E
  dump:   torchrun --nproc_per_node 8 10_hubert_train_and_dump.py dump --data D --exp E --layer 9
          (writes E/feats/{split}_{rank}.npy + .len for learn_kmeans.py / dump_km_label.py)
"""
import argparse
import logging
import os
import random
import time

import numpy as np
import soundfile as sf
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
logger = logging.getLogger("hubert")

CONV = [(512, 10, 5)] + [(512, 3, 2)] * 4 + [(512, 2, 2)] * 2


def n_frames(n):
    for _, k, s in CONV:
        n = (n - k) // s + 1
    return n


class HubertModel(nn.Module):
    def __init__(self, num_classes=500, dim=768, layers=12):
        super().__init__()
        mods, c_in = [], 1
        for i, (c, k, s) in enumerate(CONV):
            mods.append(nn.Conv1d(c_in, c, k, s, bias=False))
            if i == 0:
                mods.append(nn.GroupNorm(c, c))
            mods.append(nn.GELU())
            c_in = c
        self.feature_extractor = nn.Sequential(*mods)
        self.layer_norm = nn.LayerNorm(512)
        self.post_extract_proj = nn.Linear(512, dim)
        self.mask_emb = nn.Parameter(torch.FloatTensor(dim).uniform_())
        self.pos_conv = nn.Conv1d(dim, dim, 128, padding=64, groups=16)
        self.encoder_ln = nn.LayerNorm(dim)
        self.layers = nn.ModuleList([nn.TransformerEncoderLayer(dim, 12, 3072, 0.1, "gelu", batch_first=True)
                                     for _ in range(layers)])
        self.final_proj = nn.Linear(dim, 256)
        self.label_embs = nn.Parameter(torch.FloatTensor(num_classes, 256).uniform_())

    def forward(self, source, mask=None, output_layer=None):
        feats = self.layer_norm(self.feature_extractor(source.unsqueeze(1)).transpose(1, 2))
        pen = feats.float().pow(2).mean()
        x = self.post_extract_proj(feats)
        if mask is not None:
            x = torch.where(mask.unsqueeze(-1), self.mask_emb.to(x.dtype), x)
        x = self.encoder_ln(x + F.gelu(self.pos_conv(x.transpose(1, 2))[..., :-1]).transpose(1, 2))
        for i, layer in enumerate(self.layers, start=1):
            x = layer(x)
            if output_layer == i:
                return x
        logits = F.cosine_similarity(self.final_proj(x).float().unsqueeze(2),
                                     self.label_embs.float()[None, None], dim=-1) / 0.1
        return logits, pen


def read_split(data, split):
    with open(os.path.join(data, f"{split}.tsv")) as f:
        root = f.readline().strip()
        return [(os.path.join(root, p), int(n)) for p, n in (l.strip().split("\t") for l in f if l.strip())]


class KmLabeled(Dataset):
    def __init__(self, items, km_file, max_len=250000):
        self.items = items
        with open(km_file) as f:
            self.labels = [np.array(l.split(), dtype=np.int64) for l in f]
        assert len(self.labels) == len(items)
        self.max_len = max_len

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        wav, _ = sf.read(self.items[i][0], dtype="float32")
        lab = self.labels[i]
        if len(wav) > self.max_len:
            s = random.randint(0, (len(wav) - self.max_len) // 320)
            wav, lab = wav[s * 320:s * 320 + self.max_len], lab[s:s + self.max_len // 320]
        return torch.from_numpy(wav), torch.from_numpy(lab)


def collate(batch):
    n = min(len(w) for w, _ in batch)
    t = min(n_frames(n), min(len(l) for _, l in batch))
    return torch.stack([w[:n] for w, _ in batch]), torch.stack([l[:t] for _, l in batch])


def span_mask(B, T, p=0.8, span=10):
    m = np.zeros((B, T), dtype=bool)
    k = int(p * T / span + np.random.rand())
    for b in range(B):
        for s in np.random.choice(T - span, k, replace=False):
            m[b, s:s + span] = True
    return torch.from_numpy(m)


def setup():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    if dist.get_rank() != 0:
        logger.setLevel(logging.WARNING)
    return dist.get_rank(), dist.get_world_size(), torch.device("cuda", local_rank)


def train(args):
    rank, world, dev = setup()
    ckpt_dir = os.path.join(args.exp, "checkpoints")
    os.makedirs(ckpt_dir, exist_ok=True)

    tr = KmLabeled(read_split(args.data, "train"), os.path.join(args.labels, "train.km"))
    va = KmLabeled(read_split(args.data, "valid"), os.path.join(args.labels, "valid.km"))
    sampler = DistributedSampler(tr, shuffle=True, drop_last=True)
    loader = DataLoader(tr, args.batch_size, sampler=sampler, collate_fn=collate, num_workers=8,
                        pin_memory=True, drop_last=True)
    vloader = DataLoader(torch.utils.data.Subset(va, range(rank, len(va), world)), args.batch_size,
                         collate_fn=collate, num_workers=2)

    model = DDP(HubertModel(args.num_classes).to(dev), device_ids=[dev.index])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), eps=1e-6, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, s / args.warmup) *
                                              max(0.0, 1 - max(0, s - args.warmup) / (args.max_update - args.warmup)))
    last = os.path.join(ckpt_dir, "checkpoint_last.pt")
    step, epoch = 0, 0
    if os.path.exists(last):
        ck = torch.load(last, map_location="cpu")
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["optimizer"])
        sched.load_state_dict(ck["lr_scheduler"])
        step, epoch = ck["step"], ck["epoch"]
        logger.info("resuming from step %d", step)

    while step < args.max_update:
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for wav, lab in loader:
            wav, lab = wav.to(dev, non_blocking=True), lab.to(dev, non_blocking=True)
            mask = span_mask(wav.size(0), n_frames(wav.size(1))).to(dev)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits, pen = model(wav, mask)
            m = mask[:, :lab.size(1)]
            loss = F.cross_entropy(logits[:, :lab.size(1)][m], lab[m]) + 10 * pen
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            opt.step()
            sched.step()
            step += 1
            if step % 100 == 0:
                l = loss.detach()
                dist.all_reduce(l)
                logger.info("epoch %d step %d loss %.4f lr %.3e %.2fs/it", epoch, step, l.item() / world,
                            sched.get_last_lr()[0], (time.time() - t0) / 100)
                t0 = time.time()
            if step >= args.max_update:
                break
        epoch += 1

        model.eval()
        tot = torch.zeros(2, device=dev)
        with torch.no_grad():
            for wav, lab in vloader:
                wav, lab = wav.to(dev), lab.to(dev)
                mask = span_mask(wav.size(0), n_frames(wav.size(1))).to(dev)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    logits, _ = model.module(wav, mask)
                m = mask[:, :lab.size(1)]
                tot[0] += (logits[:, :lab.size(1)][m].argmax(-1) == lab[m]).sum()
                tot[1] += m.sum()
        dist.all_reduce(tot)
        logger.info("epoch %d valid acc_m %.4f", epoch, (tot[0] / tot[1]).item())

        if rank == 0:
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                        "lr_scheduler": sched.state_dict(), "step": step, "epoch": epoch,
                        "num_classes": args.num_classes}, last + ".tmp")
            os.replace(last + ".tmp", last)
        dist.barrier()
    dist.destroy_process_group()


@torch.no_grad()
def dump(args):
    rank, world, dev = setup()
    ck = torch.load(os.path.join(args.exp, "checkpoints", "checkpoint_last.pt"), map_location="cpu")
    model = HubertModel(ck["num_classes"])
    model.load_state_dict(ck["model"])
    model.to(dev).eval()

    out_dir = os.path.join(args.exp, "feats")
    os.makedirs(out_dir, exist_ok=True)
    for split in ("train", "valid"):
        items = read_split(args.data, split)[rank::world]
        feats, lens = [], []
        for path, _ in items:
            wav, _ = sf.read(path, dtype="float32")
            x = torch.from_numpy(wav).to(dev)[None]
            chunks = [model(x[:, s:s + args.max_chunk], output_layer=args.layer)
                      for s in range(0, x.size(1), args.max_chunk)]
            f = torch.cat(chunks, 1)[0].cpu().numpy()
            feats.append(f)
            lens.append(len(f))
        np.save(os.path.join(out_dir, f"{split}_{rank}_{world}.npy"), np.concatenate(feats))
        with open(os.path.join(out_dir, f"{split}_{rank}_{world}.len"), "w") as f:
            f.write("\n".join(map(str, lens)) + "\n")
        logger.info("rank %d dumped %d %s utterances", rank, len(items), split)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["train", "dump"])
    ap.add_argument("--data", required=True)
    ap.add_argument("--labels")
    ap.add_argument("--exp", required=True)
    ap.add_argument("--num-classes", type=int, default=500)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--warmup", type=int, default=32000)
    ap.add_argument("--max-update", type=int, default=400000)
    ap.add_argument("--layer", type=int, default=9)
    ap.add_argument("--max-chunk", type=int, default=1600000)
    args = ap.parse_args()
    train(args) if args.mode == "train" else dump(args)
