#!/usr/bin/env python
"""Search-query -> product-image retrieval.

A text tower encodes search queries; product images are encoded by an online image tower and
by its momentum copy, whose keys (from all ranks) fill a queue of product negatives. Clicked
(query, product) pairs are the positives.

    torchrun --nproc_per_node=8 18_query2product_moco_resume.py --config configs/q2p.yaml
    torchrun --nproc_per_node=8 18_query2product_moco_resume.py --config configs/q2p.yaml \
        --resume runs/q2p/ckpt_last.pt
"""
import argparse
import copy
import json
import logging
import os
import time

import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms as T
from transformers import AutoModel, AutoTokenizer

logger = logging.getLogger("q2p")

DEFAULTS = dict(
    text_model="intfloat/multilingual-e5-base", image_model="convnext_small.fb_in22k_ft_in1k", dim=256,
    queue_size=65536, momentum=0.995, tau=0.05, batch_size=128, lr=5e-5, weight_decay=0.05, epochs=8,
    warmup_ratio=0.05, workers=8, output_dir="runs/q2p", max_len=32,
)


def load_config():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--resume", default="")
    a = ap.parse_args()
    cfg = dict(DEFAULTS)
    with open(a.config) as f:
        cfg.update(yaml.safe_load(f) or {})
    cfg["resume"] = a.resume
    return argparse.Namespace(**cfg)


class ClickPairs(Dataset):
    def __init__(self, path, image_root, tf):
        with open(path) as f:
            self.rows = [json.loads(l) for l in f]
        self.image_root, self.tf = image_root, tf

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        img = self.tf(Image.open(os.path.join(self.image_root, r["image"])).convert("RGB"))
        return "query: " + r["query"], img, r["product_id"]


class Q2P(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.text = AutoModel.from_pretrained(cfg.text_model, add_pooling_layer=False)
        self.image = timm.create_model(cfg.image_model, pretrained=True, num_classes=0)
        self.text_head = nn.Linear(self.text.config.hidden_size, cfg.dim)
        self.image_head = nn.Linear(self.image.num_features, cfg.dim)
        self.image_m = copy.deepcopy(self.image)
        self.image_head_m = copy.deepcopy(self.image_head)
        for p in list(self.image_m.parameters()) + list(self.image_head_m.parameters()):
            p.requires_grad = False
        self.m, self.tau, self.K = cfg.momentum, cfg.tau, cfg.queue_size
        self.register_buffer("queue", F.normalize(torch.randn(cfg.queue_size, cfg.dim), dim=1))
        self.register_buffer("queue_pid", torch.full((cfg.queue_size,), -1, dtype=torch.long))
        self.register_buffer("queue_ptr", torch.zeros((), dtype=torch.long))

    def encode_query(self, ids, mask):
        h = self.text(input_ids=ids, attention_mask=mask).last_hidden_state
        h = (h * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
        return F.normalize(self.text_head(h), dim=-1)

    def encode_image(self, x):
        return F.normalize(self.image_head(self.image(x)), dim=-1)

    @torch.no_grad()
    def _momentum_keys(self, x):
        for src, dst in ((self.image, self.image_m), (self.image_head, self.image_head_m)):
            for p, pm in zip(src.parameters(), dst.parameters()):
                pm.mul_(self.m).add_(p.detach(), alpha=1 - self.m)
        return F.normalize(self.image_head_m(self.image_m(x)), dim=-1)

    def forward(self, ids, mask, img, pid):
        q = self.encode_query(ids, mask)
        p = self.encode_image(img)
        k = self._momentum_keys(img)
        pos_online = (q * p).sum(1, keepdim=True)
        neg = q @ self.queue.clone().T
        neg = neg.masked_fill(self.queue_pid[None, :] == pid[:, None], -1e4)
        logits = torch.cat([pos_online, neg], dim=1) / self.tau
        loss = F.cross_entropy(logits, torch.zeros(len(q), dtype=torch.long, device=q.device))
        # keep the online image tower close to its momentum keys
        loss = loss + (1 - (p * k).sum(1)).mean()
        self._enqueue(k, pid)
        return loss

    @torch.no_grad()
    def _enqueue(self, k, pid):
        k, pid = gather(k), gather(pid)
        slots = (self.queue_ptr + torch.arange(len(k), device=k.device)) % self.K
        self.queue[slots], self.queue_pid[slots] = k, pid
        self.queue_ptr.copy_((self.queue_ptr + len(k)) % self.K)


@torch.no_grad()
def gather(t):
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return torch.cat(out)


@torch.no_grad()
def evaluate(model, val_ds, tok, cfg, device, ks=(1, 10, 50)):
    """Queries of this rank against the product images of the whole validation set."""
    model.eval()
    rank, world = dist.get_rank(), dist.get_world_size()
    sampler = DistributedSampler(val_ds, shuffle=False)
    loader = DataLoader(val_ds, batch_size=256, sampler=sampler, num_workers=cfg.workers,
                        collate_fn=lambda b: list(zip(*b)))
    qs, ims, pids = [], [], []
    for texts, imgs, pid in loader:
        enc = tok(list(texts), padding=True, truncation=True, max_length=cfg.max_len, return_tensors="pt").to(device)
        qs.append(model.encode_query(enc.input_ids, enc.attention_mask))
        ims.append(model.encode_image(torch.stack(imgs).to(device)))
        pids.append(torch.tensor(pid, device=device))
    q, q_pid = torch.cat(qs), torch.cat(pids)
    idx = torch.tensor(list(iter(sampler)), device=device)
    gallery = torch.zeros(len(val_ds), q.shape[1], device=device)
    g_pid = torch.zeros(len(val_ds), dtype=torch.long, device=device)
    all_idx = gather(idx)
    gallery[all_idx], g_pid[all_idx] = gather(torch.cat(ims)), gather(q_pid)
    # the sampler pads the last ranks with repeats of the first samples: count every query once
    real = torch.arange(len(idx), device=device) * world + rank < len(val_ds)
    q, q_pid = q[real], q_pid[real]
    top = (q @ gallery.T).topk(max(ks), dim=1).indices
    hit = g_pid[top] == q_pid[:, None]
    c = torch.tensor([float(hit[:, :k].any(1).sum()) for k in ks] + [float(len(q))], device=device)
    dist.all_reduce(c)
    model.train()
    return {f"R@{k}": 100 * (c[j] / c[-1]).item() for j, k in enumerate(ks)}


def save_checkpoint(path, model, optimizer, scheduler, epoch, best):
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(), "epoch": epoch, "best": best}, path)


def main():
    cfg = load_config()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARN, format="%(asctime)s %(message)s")

    tok = AutoTokenizer.from_pretrained(cfg.text_model)
    norm = T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    tr = T.Compose([T.RandomResizedCrop(224, scale=(0.6, 1.0)), T.RandomHorizontalFlip(), T.ToTensor(), norm])
    te = T.Compose([T.Resize(224), T.CenterCrop(224), T.ToTensor(), norm])
    train_ds = ClickPairs(cfg.train_file, cfg.image_root, tr)
    val_ds = ClickPairs(cfg.val_file, cfg.image_root, te)

    def collate(batch):
        texts, imgs, pid = zip(*batch)
        enc = tok(list(texts), padding=True, truncation=True, max_length=cfg.max_len, return_tensors="pt")
        return enc.input_ids, enc.attention_mask, torch.stack(imgs), torch.tensor(pid)

    sampler = DistributedSampler(train_ds, shuffle=True)
    loader = DataLoader(train_ds, batch_size=cfg.batch_size, sampler=sampler, num_workers=cfg.workers,
                        collate_fn=collate, pin_memory=True, drop_last=True, persistent_workers=True)

    model = Q2P(cfg).to(device)
    lr = cfg.lr * cfg.batch_size * world / 1024
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr,
                                  weight_decay=cfg.weight_decay)
    total = cfg.epochs * len(loader)
    warm = int(cfg.warmup_ratio * total)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / max(1, warm)) * max(0.0, (total - s) / max(1, total - warm)))

    start_epoch, best = 0, 0.0
    if cfg.resume:
        ckpt = torch.load(cfg.resume, map_location="cpu")
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch, best = ckpt["epoch"], ckpt["best"]
        logger.info("resumed from %s (epoch %d)", cfg.resume, start_epoch)

    model = DDP(model, device_ids=[local_rank])
    if rank == 0:
        os.makedirs(cfg.output_dir, exist_ok=True)

    for epoch in range(start_epoch, cfg.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for step, (ids, mask, img, pid) in enumerate(loader):
            ids, mask = ids.to(device, non_blocking=True), mask.to(device, non_blocking=True)
            img, pid = img.to(device, non_blocking=True), pid.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(ids, mask, img, pid)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            if step % 100 == 0:
                logger.info("epoch %d step %d/%d loss %.4f lr %.2e", epoch, step, len(loader), loss.item(),
                            scheduler.get_last_lr()[0])

        metrics = evaluate(model.module, val_ds, tok, cfg, device)
        logger.info("epoch %d (%.0fs) %s", epoch, time.time() - t0, metrics)
        if rank == 0:
            best = max(best, metrics["R@1"])
            save_checkpoint(os.path.join(cfg.output_dir, "ckpt_last.pt"), model, optimizer, scheduler, epoch + 1, best)
            if metrics["R@1"] >= best:
                save_checkpoint(os.path.join(cfg.output_dir, "ckpt_best.pt"), model, optimizer, scheduler,
                                epoch + 1, best)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
