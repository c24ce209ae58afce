"""HuBERT-style masked prediction on k-means targets, with a sanity report on
the target distribution before training starts (degenerate k-means runs with
many empty clusters are common when features were dumped from the wrong layer).

    torchrun --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint $HEAD:29500 \
        12_hubert_base_km500.py --config conf/hubert_base_it2.json
"""
import argparse
import json
import logging
import math
import os
import random
import time
from dataclasses import dataclass, field

import numpy as np
import soundfile as sf
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler


@dataclass
class Config:
    data: str = "/shared/ls960"
    labels: str = "/shared/ls960/km_it2_l6_500"
    out: str = "/shared/exp/hubert_it2"
    num_classes: int = 500
    batch_size: int = 8
    max_sample_size: int = 250000
    lr: float = 5e-4
    warmup_updates: int = 32000
    max_updates: int = 400000
    mask_prob: float = 0.8
    mask_length: int = 10
    pred_masked_weight: float = 1.0
    pred_nomask_weight: float = 0.0
    feature_pen_weight: float = 10.0
    log_interval: int = 200
    save_interval: int = 10000
    conv: list = field(default_factory=lambda: [[512, 10, 5]] + [[512, 3, 2]] * 4 + [[512, 2, 2]] * 2)


def out_len(cfg, n):
    for _, k, s in cfg.conv:
        n = (n - k) // s + 1
    return n


def read_pairs(tsv, km):
    with open(tsv) as f:
        root = f.readline().strip()
        wavs = [os.path.join(root, l.split("\t")[0]) for l in f.read().splitlines()]
    with open(km) as f:
        labs = f.read().splitlines()
    assert len(wavs) == len(labs)
    return wavs, labs


class PairDataset(Dataset):
    def __init__(self, wavs, labs, max_size):
        self.wavs, self.labs, self.max_size = wavs, labs, max_size

    def __len__(self):
        return len(self.wavs)

    def __getitem__(self, i):
        wav, _ = sf.read(self.wavs[i], dtype="float32")
        lab = np.array(self.labs[i].split(), dtype=np.int64)
        if len(wav) > self.max_size:
            s = random.randint(0, (len(wav) - self.max_size) // 320)
            wav = wav[s * 320: s * 320 + self.max_size]
            lab = lab[s: s + self.max_size // 320]
        return torch.from_numpy(wav), torch.from_numpy(lab)


class Collater:
    def __init__(self, cfg):
        self.cfg = cfg

    def __call__(self, batch):
        n = min(len(w) for w, _ in batch)
        t = min(out_len(self.cfg, n), min(len(l) for _, l in batch))
        return torch.stack([w[:n] for w, _ in batch]), torch.stack([l[:t] for _, l in batch])


class HubertPretrain(nn.Module):
    def __init__(self, cfg, d=768):
        super().__init__()
        convs, c_in = [], 1
        for i, (c, k, s) in enumerate(cfg.conv):
            convs += [nn.Conv1d(c_in, c, k, s, bias=False)]
            convs += [nn.GroupNorm(c, c)] if i == 0 else []
            convs += [nn.GELU()]
            c_in = c
        self.cnn = nn.Sequential(*convs)
        self.cnn_norm = nn.LayerNorm(512)
        self.proj = nn.Linear(512, d)
        self.mask_emb = nn.Parameter(torch.empty(d).uniform_())
        self.pos_conv = nn.Conv1d(d, d, 128, padding=64, groups=16)
        self.norm = nn.LayerNorm(d)
        self.transformer = nn.TransformerEncoder(
            nn.TransformerEncoderLayer(d, 12, 3072, 0.1, "gelu", batch_first=True), 12, enable_nested_tensor=False)
        self.final_proj = nn.Linear(d, 256)
        self.label_embs = nn.Parameter(torch.empty(cfg.num_classes, 256).uniform_())

    def forward(self, wav, mask):
        f = self.cnn_norm(self.cnn(wav[:, None]).transpose(1, 2))
        x = self.proj(f)
        x = torch.where(mask[..., None], self.mask_emb.to(x.dtype), x)
        x = self.norm(x + F.gelu(self.pos_conv(x.transpose(1, 2))[..., :-1].transpose(1, 2)))
        y = self.final_proj(self.transformer(x)).float()
        logits = F.normalize(y, dim=-1) @ F.normalize(self.label_embs.float(), dim=-1).T
        return logits / 0.1, f.float().pow(2).mean()


def span_mask(cfg, B, T):
    mask = torch.zeros(B, T, dtype=torch.bool)
    k = int(cfg.mask_prob * T / cfg.mask_length + random.random())
    for b in range(B):
        for s in random.sample(range(T - cfg.mask_length), k):
            mask[b, s:s + cfg.mask_length] = True
    return mask


def label_report(labs, cfg, rank, world):
    counts = np.zeros(cfg.num_classes, dtype=np.int64)
    for line in labs[rank::world]:
        counts += np.bincount(np.array(line.split(), dtype=np.int64), minlength=cfg.num_classes)
    counts = torch.from_numpy(counts)
    dist.all_reduce(counts)
    p = counts.double() / counts.sum()
    ent = -(p[p > 0] * p[p > 0].log2()).sum().item()
    return int((counts == 0).sum()), ent, int(counts.sum())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config")
    cli = ap.parse_args()
    cfg = Config(**json.load(open(cli.config))) if cli.config else Config()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s %(message)s")
    log = logging.getLogger("hubert")

    tr_w, tr_l = read_pairs(os.path.join(cfg.data, "train.tsv"), os.path.join(cfg.labels, "train.km"))
    va_w, va_l = read_pairs(os.path.join(cfg.data, "valid.tsv"), os.path.join(cfg.labels, "valid.km"))
    empty, ent, frames = label_report(tr_l, cfg, rank, world)
    log.info("targets: %d frames, %d/%d clusters empty, entropy %.2f bits (max %.2f)",
             frames, empty, cfg.num_classes, ent, math.log2(cfg.num_classes))

    train = PairDataset(tr_w, tr_l, cfg.max_sample_size)
    valid = PairDataset(va_w, va_l, cfg.max_sample_size)
    sampler = DistributedSampler(train, shuffle=True, drop_last=True)
    loader = DataLoader(train, cfg.batch_size, sampler=sampler, collate_fn=Collater(cfg), num_workers=8,
                        pin_memory=True, drop_last=True)
    vloader = DataLoader(torch.utils.data.Subset(valid, list(range(rank, len(valid), world))), cfg.batch_size,
                         collate_fn=Collater(cfg), num_workers=2)

    model = DDP(HubertPretrain(cfg).to(dev), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.98), eps=1e-6, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: s / cfg.warmup_updates if s < cfg.warmup_updates
        else max(0.0, (cfg.max_updates - s) / (cfg.max_updates - cfg.warmup_updates)))
    if rank == 0:
        os.makedirs(cfg.out, exist_ok=True)

    step, epoch = 0, 0
    t0 = time.time()
    while step < cfg.max_updates:
        sampler.set_epoch(epoch)
        model.train()
        for wav, lab in loader:
            wav, lab = wav.to(dev, non_blocking=True), lab.to(dev, non_blocking=True)
            mask = span_mask(cfg, wav.size(0), out_len(cfg, wav.size(1))).to(dev)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits, pen = model(wav, mask)
            T = lab.size(1)
            m, u = mask[:, :T], ~mask[:, :T]
            loss = cfg.pred_masked_weight * F.cross_entropy(logits[:, :T][m], lab[m])
            if cfg.pred_nomask_weight > 0:
                loss = loss + cfg.pred_nomask_weight * F.cross_entropy(logits[:, :T][u], lab[u])
            loss = loss + cfg.feature_pen_weight * pen
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            opt.step()
            sched.step()
            step += 1
            if step % cfg.log_interval == 0:
                r = loss.detach().float()
                dist.all_reduce(r, op=dist.ReduceOp.AVG)
                log.info("step %d loss %.4f lr %.2e %.2fs/it", step, r.item(), sched.get_last_lr()[0],
                         (time.time() - t0) / cfg.log_interval)
                t0 = time.time()
            if step % cfg.save_interval == 0 and rank == 0:
                torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "step": step,
                            "cfg": cfg.__dict__}, os.path.join(cfg.out, f"checkpoint_{step}.pt"))
            if step >= cfg.max_updates:
                break
        epoch += 1

        model.eval()
        acc = torch.zeros(2, device=dev)
        with torch.no_grad():
            for wav, lab in vloader:
                wav, lab = wav.to(dev), lab.to(dev)
                mask = span_mask(cfg, wav.size(0), out_len(cfg, wav.size(1))).to(dev)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    logits, _ = model.module(wav, mask)
                m = mask[:, :lab.size(1)]
                acc += torch.stack([(logits[:, :lab.size(1)][m].argmax(-1) == lab[m]).sum(), m.sum()]).float()
        dist.all_reduce(acc)
        log.info("epoch %d: valid masked acc %.4f", epoch, (acc[0] / acc[1]).item())

    if rank == 0:
        torch.save({"model": model.module.state_dict(), "step": step, "cfg": cfg.__dict__},
                   os.path.join(cfg.out, "checkpoint_last.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
