"""
ICD-10 coding of emergency-department notes with a chunked clinical encoder, max-pooled over chunks,
trained with a focal BCE (gamma=2, alpha tuned per run) for the long tail of codes.

Config is a YAML file; CLI flags override it:
    torchrun --nproc_per_node=4 17_icd_focal_ckpt.py --config configs/ed_icd10.yaml --epochs 12
"""
import argparse
import logging
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from sklearn.metrics import average_precision_score, f1_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModel, get_linear_schedule_with_warmup

log = logging.getLogger("ed_icd")

DEFAULTS = dict(data_dir="data/ed_icd10", encoder="medicalai/ClinicalBERT", out_dir="runs/ed_icd10_focal",
                max_chunks=8, batch_size=4, lr=3e-5, epochs=10, warmup=0.1, gamma=2.0, alpha=0.25,
                threshold=0.3, seed=99, num_workers=4)


def load_cfg():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config")
    for k, v in DEFAULTS.items():
        ap.add_argument(f"--{k}", type=type(v), default=None)
    ns = ap.parse_args()
    cfg = dict(DEFAULTS)
    if ns.config:
        cfg.update(yaml.safe_load(open(ns.config)) or {})
    cfg.update({k: v for k, v in vars(ns).items() if v is not None and k != "config"})
    return argparse.Namespace(**cfg)


class FocalBCE(nn.Module):
    def __init__(self, gamma=2.0, alpha=0.25):
        super().__init__()
        self.gamma, self.alpha = gamma, alpha

    def forward(self, logits, targets):
        bce = F.binary_cross_entropy_with_logits(logits, targets, reduction="none")
        p = torch.sigmoid(logits)
        p_t = p * targets + (1 - p) * (1 - targets)
        a_t = self.alpha * targets + (1 - self.alpha) * (1 - targets)
        return (a_t * (1 - p_t) ** self.gamma * bce).sum(1).mean()


class ChunkedED(Dataset):
    """Pre-tokenised by scripts/chunk_notes.py: {"chunks": LongTensor[n,512], "y": FloatTensor[L]} per visit."""

    def __init__(self, path, max_chunks):
        self.items = torch.load(path)
        self.max_chunks = max_chunks

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        it = self.items[i]
        c = it["chunks"][: self.max_chunks]
        x = torch.zeros(self.max_chunks, c.size(1), dtype=torch.long)
        x[: c.size(0)] = c
        m = torch.zeros(self.max_chunks, dtype=torch.bool)
        m[: c.size(0)] = True
        return x, m, it["y"]


class MaxPoolChunks(nn.Module):
    def __init__(self, encoder, n_labels):
        super().__init__()
        self.encoder = AutoModel.from_pretrained(encoder, add_pooling_layer=False)
        self.head = nn.Linear(self.encoder.config.hidden_size, n_labels)

    def forward(self, x, m):
        b, c, t = x.shape
        h = self.encoder(input_ids=x.view(-1, t), attention_mask=(x.view(-1, t) != 0).long()).last_hidden_state
        tok_logits = self.head(h)                                        # (b*c) x t x L
        tok_logits = tok_logits.masked_fill((x.view(-1, t) == 0).unsqueeze(-1), -1e4)
        chunk_logits = tok_logits.max(1).values.view(b, c, -1)
        chunk_logits = chunk_logits.masked_fill(~m.unsqueeze(-1), -1e4)
        return chunk_logits.max(1).values


def save_checkpoint(path, model, opt, sched, epoch, metrics):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.save({"model": model.module.state_dict(), "optimizer": opt.state_dict(),
                "scheduler": sched.state_dict(), "epoch": epoch, "metrics": metrics}, path)


@torch.no_grad()
def evaluate(model, loader, device, threshold):
    model.eval()
    probs, golds = [], []
    for x, m, y in loader:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(x.to(device), m.to(device))
        probs.append(torch.sigmoid(logits.float()).cpu())
        golds.append(y)
    probs, golds = torch.cat(probs), torch.cat(golds)
    gp = [None] * dist.get_world_size()
    dist.all_gather_object(gp, (probs, golds))
    probs = torch.cat([p for p, _ in gp]).numpy()
    golds = torch.cat([g for _, g in gp]).numpy()
    pred = (probs >= threshold).astype(int)
    present = golds.sum(0) > 0
    return {"micro_f1": f1_score(golds, pred, average="micro", zero_division=0),
            "macro_f1": f1_score(golds[:, present], pred[:, present], average="macro", zero_division=0),
            "macro_ap": average_precision_score(golds[:, present], probs[:, present], average="macro")}


def main():
    cfg = load_cfg()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")

    train_ds = ChunkedED(os.path.join(cfg.data_dir, "train.pt"), cfg.max_chunks)
    dev_ds = ChunkedED(os.path.join(cfg.data_dir, "dev.pt"), cfg.max_chunks)
    n_labels = train_ds.items[0]["y"].numel()
    sampler = DistributedSampler(train_ds, shuffle=True, seed=cfg.seed)
    train_dl = DataLoader(train_ds, batch_size=cfg.batch_size, sampler=sampler, num_workers=cfg.num_workers,
                          pin_memory=True, drop_last=True)
    dev_dl = DataLoader(torch.utils.data.Subset(dev_ds, range(rank, len(dev_ds), world)),
                        batch_size=cfg.batch_size * 2, num_workers=cfg.num_workers)

    model = DDP(MaxPoolChunks(cfg.encoder, n_labels).to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01)
    total = len(train_dl) * cfg.epochs
    sched = get_linear_schedule_with_warmup(opt, int(cfg.warmup * total), total)
    criterion = FocalBCE(cfg.gamma, cfg.alpha)

    best = -1.0
    for epoch in range(cfg.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0, run = time.time(), torch.zeros(2, device=device)
        for step, (x, m, y) in enumerate(train_dl):
            x, m, y = x.to(device, non_blocking=True), m.to(device), y.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(x, m)
            loss = criterion(logits.float(), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            run += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(run)

        metrics = evaluate(model.module, dev_dl, device, cfg.threshold)
        log.info("epoch %d | loss %.4f | micro-F1 %.4f macro-F1 %.4f macro-AP %.4f | %.0fs", epoch,
                 (run[0] / run[1]).item(), metrics["micro_f1"], metrics["macro_f1"], metrics["macro_ap"],
                 time.time() - t0)
        save_checkpoint(os.path.join(cfg.out_dir, "last.pt"), model, opt, sched, epoch, metrics)
        if metrics["micro_f1"] > best:
            best = metrics["micro_f1"]
            save_checkpoint(os.path.join(cfg.out_dir, "best.pt"), model, opt, sched, epoch, metrics)
        dist.barrier()

    log.info("best dev micro-F1 %.4f", best)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
