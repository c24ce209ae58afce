"""ESC-50 with a ViT-Base spectrogram transformer, started with torch.multiprocessing.spawn (one node).

The lower blocks are frozen, the upper blocks use activation checkpointing to fit 5 s clips at
batch 24 per GPU. Resumable from the last checkpoint.

    python 18_esc50_vit_spawn.py --root /data/ESC-50-master --init ckpt/vit_base_as2m.pth --fold 3
"""
import argparse
import os
import random
import socket
import time

import numpy as np
import pandas as pd
import soundfile as sf
import timm
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchaudio.transforms import FrequencyMasking, MelSpectrogram, TimeMasking

SR = 16000
N_FRAMES = 512


class ESC50(Dataset):
    def __init__(self, root, folds):
        meta = pd.read_csv(os.path.join(root, "meta", "esc50.csv"))
        meta = meta[meta.fold.isin(folds)]
        self.paths = [os.path.join(root, "audio_16k", f) for f in meta.filename]
        self.labels = meta.target.tolist()

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        wav, _ = sf.read(self.paths[i], dtype="float32")
        return torch.from_numpy(wav[: 5 * SR]), self.labels[i]


def collate_pad(batch):
    n = 5 * SR
    wav = torch.zeros(len(batch), n)
    for k, (w, _) in enumerate(batch):
        wav[k, : w.numel()] = w
    return wav, torch.tensor([y for _, y in batch])


class SpecViT(nn.Module):
    def __init__(self, num_classes, n_frozen, drop_path=0.1):
        super().__init__()
        self.vit = timm.create_model("vit_base_patch16_224", pretrained=False, img_size=(128, N_FRAMES),
                                     in_chans=1, num_classes=num_classes, drop_path_rate=drop_path)
        self.n_frozen = n_frozen
        for p in self.vit.patch_embed.parameters():
            p.requires_grad_(False)
        self.vit.pos_embed.requires_grad_(False)
        self.vit.cls_token.requires_grad_(False)
        for blk in self.vit.blocks[:n_frozen]:
            for p in blk.parameters():
                p.requires_grad_(False)

    def forward(self, x):
        v = self.vit
        x = v._pos_embed(v.patch_embed(x))
        x = v.norm_pre(x)
        for i, blk in enumerate(v.blocks):
            if i >= self.n_frozen and self.training:
                x = checkpoint(blk, x, use_reentrant=False)
            else:
                x = blk(x)
        return v.forward_head(v.norm(x))


class Frontend(nn.Module):
    def __init__(self):
        super().__init__()
        self.mel = MelSpectrogram(SR, n_fft=400, hop_length=160, n_mels=128, f_min=20, f_max=8000)
        self.aug = nn.Sequential(FrequencyMasking(24, iid_masks=True), TimeMasking(96, iid_masks=True))

    @torch.no_grad()
    def forward(self, wav, augment):
        x = torch.log(self.mel(wav) + 1e-6)
        x = F.pad(x, (0, max(0, N_FRAMES - x.size(-1))), value=float(np.log(1e-6)))[..., :N_FRAMES].unsqueeze(1)
        x = (x + 6.63) / (2 * 5.36)
        return self.aug(x) if augment else x


def find_free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


@torch.no_grad()
def evaluate(model, frontend, loader, device):
    model.eval()
    counts = torch.zeros(2, device=device, dtype=torch.long)
    for wav, y in loader:
        pred = model(frontend(wav.to(device), augment=False)).argmax(1)
        counts[0] += (pred == y.to(device)).sum()
        counts[1] += y.numel()
    dist.all_reduce(counts)
    return counts[0].item() / counts[1].item()


def worker(rank, world_size, args):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed)

    train_set = ESC50(args.root, [f for f in range(1, 6) if f != args.fold])
    test_set = ESC50(args.root, [args.fold])
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, collate_fn=collate_pad,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    test_loader = DataLoader(test_set, batch_size=50, sampler=range(rank, len(test_set), world_size),
                             collate_fn=collate_pad, num_workers=args.workers)

    model = SpecViT(50, n_frozen=args.freeze_blocks)
    if args.init:
        sd = torch.load(args.init, map_location="cpu")
        sd = {k: v for k, v in sd.items() if not k.startswith("head.")}
        missing, _ = model.vit.load_state_dict(sd, strict=False)
        if rank == 0:
            print("not initialised:", missing, flush=True)
    model = DDP(model.to(device), device_ids=[rank])
    frontend = Frontend().to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr * world_size * args.batch_size / 96, weight_decay=0.05)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)

    ckpt_path = os.path.join(args.out, f"fold{args.fold}_last.pt")
    start = 0
    if os.path.exists(ckpt_path):
        # saved from rank 0's GPU; remap onto this rank's device
        state = torch.load(ckpt_path, map_location={"cuda:0": f"cuda:{rank}"})
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        start = state["epoch"] + 1

    best = 0.0
    for epoch in range(start, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for wav, y in train_loader:
            wav, y = wav.to(device, non_blocking=True), y.to(device, non_blocking=True)
            x = frontend(wav, augment=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(x)
            loss = F.cross_entropy(logits.float(), y, label_smoothing=0.1)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        sched.step()

        acc = evaluate(model.module, frontend, test_loader, device)
        if rank == 0:
            print(f"fold {args.fold} epoch {epoch}: acc {acc:.4f} ({time.time() - t0:.0f}s)", flush=True)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch}, ckpt_path)
        best = max(best, acc)
        dist.barrier()

    if rank == 0:
        print(f"fold {args.fold}: best acc {best:.4f}")
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--init", default="")
    ap.add_argument("--fold", type=int, default=1)
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--batch-size", type=int, default=24)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--freeze-blocks", type=int, default=4)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="exp/esc50_vit")
    args = ap.parse_args()

    os.makedirs(args.out, exist_ok=True)
    world_size = torch.cuda.device_count()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", find_free_port())
    mp.spawn(worker, args=(world_size, args), nprocs=world_size, join=True)


if __name__ == "__main__":
    main()
