"""Fine-tune a BEATs (iter3) encoder on AudioSet-20K / AS-2M for multi-label tagging.

    torchrun --nproc_per_node=8 05_audioset_beats_finetune.py \
        --beats-ckpt ckpt/BEATs_iter3.pt --train-csv lists/balanced_train.csv \
        --eval-csv lists/eval.csv --out runs/beats_as20k
"""
import argparse
import csv
import logging
import math
import os
import time

import numpy as np
import soundfile as sf
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from scipy.stats import norm
from sklearn.metrics import average_precision_score, roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from BEATs import BEATs, BEATsConfig

logger = logging.getLogger("beats_ft")


class AudioSetClips(Dataset):
    """CSV rows: path,mid1;mid2;... (16 kHz mono wavs, 10 s)."""

    def __init__(self, csv_path, label_index, seconds=10.0, sr=16000):
        self.rows = []
        with open(csv_path) as f:
            for path, mids in csv.reader(f):
                self.rows.append((path, [label_index[m] for m in mids.split(";") if m in label_index]))
        self.num_classes = len(label_index)
        self.length = int(seconds * sr)

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        path, labels = self.rows[i]
        wav, _ = sf.read(path, dtype="float32")
        if wav.ndim == 2:
            wav = wav.mean(-1)
        out = np.zeros(self.length, np.float32)
        out[: min(self.length, len(wav))] = wav[: self.length]
        y = np.zeros(self.num_classes, np.float32)
        y[labels] = 1.0
        return torch.from_numpy(out), torch.from_numpy(y)


class BEATsTagger(nn.Module):
    def __init__(self, ckpt_path, num_classes):
        super().__init__()
        ckpt = torch.load(ckpt_path, map_location="cpu")
        cfg = BEATsConfig(ckpt["cfg"])
        cfg.encoder_layerdrop = 0.0
        self.beats = BEATs(cfg)
        self.beats.load_state_dict(ckpt["model"])
        self.head = nn.Sequential(nn.Dropout(0.1), nn.Linear(cfg.encoder_embed_dim, num_classes))

    def forward(self, wav):
        padding_mask = torch.zeros_like(wav, dtype=torch.bool)
        feats, _ = self.beats.extract_features(wav, padding_mask=padding_mask)   # fbank is computed on GPU inside
        return self.head(feats.mean(dim=1))


def read_labels(path):
    with open(path) as f:
        reader = csv.DictReader(f)
        return {row["mid"]: int(row["index"]) for row in reader}


def mixup(wav, y, alpha):
    lam = np.random.beta(alpha, alpha)
    perm = torch.randperm(wav.size(0), device=wav.device)
    return lam * wav + (1 - lam) * wav[perm], lam * y + (1 - lam) * y[perm]


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    preds, targets = [], []
    for wav, y in loader:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(wav.to(device, non_blocking=True))
        preds.append(torch.sigmoid(logits.float()).cpu())
        targets.append(y)
    preds, targets = torch.cat(preds).numpy(), torch.cat(targets).numpy()
    present = targets.sum(0) > 0
    ap = average_precision_score(targets[:, present], preds[:, present], average=None)
    auc = roc_auc_score(targets[:, present], preds[:, present], average=None)
    mean_auc = float(np.mean(auc))
    return float(np.mean(ap)), mean_auc, float(norm.ppf(mean_auc) * math.sqrt(2))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--beats-ckpt", required=True)
    p.add_argument("--label-csv", default="lists/class_labels_indices.csv")
    p.add_argument("--train-csv", required=True)
    p.add_argument("--eval-csv", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=16, help="per GPU")
    p.add_argument("--lr", type=float, default=3e-5)
    p.add_argument("--head-lr-mult", type=float, default=10.0)
    p.add_argument("--mixup-alpha", type=float, default=0.8)
    p.add_argument("--warmup-steps", type=int, default=500)
    p.add_argument("--workers", type=int, default=8)
    args = p.parse_args()

    dist.init_process_group("nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARN,
                        format="%(asctime)s [%(levelname)s] %(message)s")
    torch.manual_seed(2024)
    np.random.seed(2024 + rank)

    label_index = read_labels(args.label_csv)
    train_set = AudioSetClips(args.train_csv, label_index)
    eval_set = AudioSetClips(args.eval_csv, label_index)
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    eval_sampler = DistributedSampler(eval_set, shuffle=False)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True,
                              persistent_workers=True, prefetch_factor=4)
    eval_loader = DataLoader(eval_set, batch_size=32, sampler=eval_sampler, num_workers=args.workers,
                             pin_memory=True)

    model = BEATsTagger(args.beats_ckpt, len(label_index)).to(device)
    model = DDP(model, device_ids=[local_rank], gradient_as_bucket_view=True)

    backbone = [p_ for n, p_ in model.module.named_parameters() if n.startswith("beats.")]
    head = [p_ for n, p_ in model.module.named_parameters() if n.startswith("head.")]
    base_lr = args.lr * world_size * args.batch_size / 128
    optimizer = torch.optim.AdamW([{"params": backbone, "lr": base_lr},
                                   {"params": head, "lr": base_lr * args.head_lr_mult}],
                                  weight_decay=0.01)
    total = args.epochs * len(train_loader)

    def lr_lambda(step):
        if step < args.warmup_steps:
            return (step + 1) / args.warmup_steps
        return 0.5 * (1 + math.cos(math.pi * (step - args.warmup_steps) / max(1, total - args.warmup_steps)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        metrics_file = open(os.path.join(args.out, "metrics.csv"), "a")
    best_map = 0.0
    global_step = 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for wav, y in train_loader:
            wav, y = wav.to(device, non_blocking=True), y.to(device, non_blocking=True)
            wav, y = mixup(wav, y, args.mixup_alpha)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(wav)
            loss = F.binary_cross_entropy_with_logits(logits.float(), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            global_step += 1
            if global_step % 100 == 0:
                logger.info("step %d loss %.4f lr %.2e", global_step, loss.item(), scheduler.get_last_lr()[0])

        mAP, mAUC, dprime = evaluate(model, eval_loader, device)
        if rank == 0:
            logger.info("epoch %d: mAP %.4f AUC %.4f d' %.3f (%.1f min)", epoch, mAP, mAUC, dprime,
                        (time.time() - t0) / 60)
            metrics_file.write(f"{epoch},{global_step},{mAP:.5f},{mAUC:.5f},{dprime:.4f}\n")
            metrics_file.flush()
            ckpt = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(), "epoch": epoch, "mAP": mAP}
            torch.save(ckpt, os.path.join(args.out, "last.pt"))
            if mAP > best_map:
                best_map = mAP
                torch.save(ckpt, os.path.join(args.out, "best.pt"))
                logger.info("new best mAP %.4f", best_map)
        dist.barrier()

    if rank == 0:
        metrics_file.close()
        logger.info("done, best mAP %.4f", best_map)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
