"""FSD50K tagging with a BEATs encoder + linear head; model selection on val, final score on eval.

    torchrun --standalone --nproc_per_node=4 14_fsd50k_beats_ckpt.py conf/beats_fsd50k.yaml
"""
import math
import os
import sys
import time

import numpy as np
import pandas as pd
import soundfile as sf
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from omegaconf import OmegaConf
from sklearn.metrics import average_precision_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from beats.BEATs import BEATs, BEATsConfig

DEFAULT_CFG = OmegaConf.create({
    "data": {"root": "/data/FSD50K", "sr": 16000, "train_seconds": 10.0, "eval_seconds": 30.0},
    "model": {"beats_ckpt": "pretrained/BEATs_iter3_plus_AS2M.pt", "freeze_cnn": True, "dropout": 0.1},
    "optim": {"lr": 5e-5, "head_lr": 1e-3, "weight_decay": 0.05, "epochs": 30, "warmup_epochs": 2,
              "batch_size": 16, "grad_clip": 2.0},
    "aug": {"mixup_alpha": 0.5},
    "out_dir": "outputs/beats_fsd50k",
    "workers": 8,
})


class FSD50KSplit(Dataset):
    def __init__(self, cfg, split, vocab):
        gt = os.path.join(cfg.data.root, "FSD50K.ground_truth")
        if split == "eval":
            meta = pd.read_csv(os.path.join(gt, "eval.csv"))
            self.dir = os.path.join(cfg.data.root, "FSD50K.eval_audio_16k")
        else:
            meta = pd.read_csv(os.path.join(gt, "dev.csv"))
            meta = meta[meta["split"] == split]
            self.dir = os.path.join(cfg.data.root, "FSD50K.dev_audio_16k")
        self.ids = meta["fname"].astype(str).tolist()
        self.y = np.zeros((len(meta), len(vocab)), np.float32)
        for r, labs in enumerate(meta["labels"]):
            self.y[r, [vocab[l] for l in labs.split(",")]] = 1
        secs = cfg.data.train_seconds if split == "train" else cfg.data.eval_seconds
        self.n = int(secs * cfg.data.sr)
        self.random_crop = split == "train"

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        wav, _ = sf.read(os.path.join(self.dir, self.ids[i] + ".wav"), dtype="float32")
        if len(wav) > self.n:
            s = np.random.randint(0, len(wav) - self.n + 1) if self.random_crop else 0
            wav = wav[s:s + self.n]
        length = len(wav)
        out = np.zeros(self.n, np.float32)
        out[:length] = wav
        return torch.from_numpy(out), length, torch.from_numpy(self.y[i])


class BEATsClassifier(nn.Module):
    def __init__(self, mcfg, n_classes):
        super().__init__()
        ckpt = torch.load(mcfg.beats_ckpt, map_location="cpu")
        bcfg = BEATsConfig(ckpt["cfg"])
        bcfg.encoder_layerdrop = 0.0
        self.encoder = BEATs(bcfg)
        self.encoder.load_state_dict(ckpt["model"], strict=False)
        if mcfg.freeze_cnn:
            for p in self.encoder.patch_embedding.parameters():
                p.requires_grad_(False)
        self.head = nn.Sequential(nn.LayerNorm(bcfg.encoder_embed_dim), nn.Dropout(mcfg.dropout),
                                  nn.Linear(bcfg.encoder_embed_dim, n_classes))

    def forward(self, wav, lengths):
        pad = torch.arange(wav.size(1), device=wav.device)[None, :] >= lengths[:, None]
        feats, feat_pad = self.encoder.extract_features(wav, padding_mask=pad)
        if feat_pad is None:
            pooled = feats.mean(1)
        else:
            keep = (~feat_pad).unsqueeze(-1).float()
            pooled = (feats * keep).sum(1) / keep.sum(1).clamp(min=1.0)
        return self.head(pooled)


@torch.no_grad()
def predict(model, loader, device):
    model.eval()
    ps, ys = [], []
    for wav, length, y in loader:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(wav.to(device), length.to(device))
        ps.append(torch.sigmoid(logits.float()).cpu().numpy())
        ys.append(y.numpy())
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, (np.concatenate(ps), np.concatenate(ys)))
    p = np.concatenate([a for a, _ in parts])
    y = np.concatenate([b for _, b in parts])
    return float(average_precision_score(y, p, average="macro"))


def make_eval_loader(ds, rank, world, workers):
    # strided, unpadded shard: every clip is scored exactly once across ranks
    return DataLoader(ds, batch_size=8, sampler=list(range(rank, len(ds), world)), num_workers=workers)


def main():
    cfg = DEFAULT_CFG
    if len(sys.argv) > 1:
        cfg = OmegaConf.merge(cfg, OmegaConf.load(sys.argv[1]), OmegaConf.from_cli(sys.argv[2:]))

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    vocab_df = pd.read_csv(os.path.join(cfg.data.root, "FSD50K.ground_truth", "vocabulary.csv"), header=None)
    vocab = {lab: int(idx) for idx, lab in zip(vocab_df[0], vocab_df[1])}
    train_ds, val_ds, eval_ds = (FSD50KSplit(cfg, s, vocab) for s in ("train", "val", "eval"))
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=cfg.optim.batch_size, sampler=sampler, num_workers=cfg.workers,
                          pin_memory=True, drop_last=True)
    val_dl = make_eval_loader(val_ds, rank, world, cfg.workers)

    model = BEATsClassifier(cfg.model, len(vocab)).to(device)
    model = DDP(model, device_ids=[local_rank])
    enc = [p for n, p in model.named_parameters() if p.requires_grad and ".encoder." in n]
    head = [p for n, p in model.named_parameters() if p.requires_grad and ".head." in n]
    scale = world * cfg.optim.batch_size / 64
    opt = torch.optim.AdamW([{"params": enc, "lr": cfg.optim.lr * scale},
                             {"params": head, "lr": cfg.optim.head_lr * scale}],
                            weight_decay=cfg.optim.weight_decay)
    total = cfg.optim.epochs * len(train_dl)
    warm = cfg.optim.warmup_epochs * len(train_dl)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / (total - warm))))

    os.makedirs(cfg.out_dir, exist_ok=True)
    best_path = os.path.join(cfg.out_dir, "best.pt")
    best = -1.0
    for epoch in range(cfg.optim.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for wav, length, y in train_dl:
            wav, length, y = wav.to(device), length.to(device), y.to(device)
            if cfg.aug.mixup_alpha > 0:
                lam = float(np.random.beta(cfg.aug.mixup_alpha, cfg.aug.mixup_alpha))
                perm = torch.randperm(wav.size(0), device=device)
                wav = lam * wav + (1 - lam) * wav[perm]
                length = torch.maximum(length, length[perm])
                y = lam * y + (1 - lam) * y[perm]
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(wav, length)
            loss = F.binary_cross_entropy_with_logits(logits.float(), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
            opt.step()
            sched.step()

        val_map = predict(model.module, val_dl, device)
        if rank == 0:
            print(f"[{epoch}] val mAP {val_map:.4f}  ({time.time() - t0:.0f}s)", flush=True)
            if val_map > best:
                torch.save({"model": model.state_dict(), "epoch": epoch, "val_mAP": val_map,
                            "cfg": OmegaConf.to_container(cfg)}, best_path)
        best = max(best, val_map)
        dist.barrier()

    # final evaluation of the selected checkpoint on the eval split (full-length clips, 30 s)
    del model, opt
    torch.cuda.empty_cache()
    final = BEATsClassifier(cfg.model, len(vocab)).to(device)
    state = torch.load(best_path, map_location=device)
    final.load_state_dict(state["model"])
    eval_map = predict(final, make_eval_loader(eval_ds, rank, world, cfg.workers), device)
    if rank == 0:
        print(f"best epoch {state['epoch']}: val mAP {state['val_mAP']:.4f}, eval mAP {eval_map:.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
