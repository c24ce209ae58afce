"""KW-MLP (gated MLP over MFCC frames) for Speech Commands, 35 words.

If no --seed is given a random one is drawn on rank 0 and shared, so that all
ranks initialise the same model and draw the same sampler permutation; the
seed is written into the checkpoint for reproduction.

    torchrun --nproc_per_node=4 20_kwmlp_seed_broadcast.py --data /data/speech_commands_v0.02 --out runs/kwmlp
"""
import argparse
import json
import os
import random
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", default="runs/kwmlp")
    p.add_argument("--seed", type=int, default=-1)
    p.add_argument("--epochs", type=int, default=140)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--warmup-epochs", type=int, default=10)
    p.add_argument("--depth", type=int, default=12)
    p.add_argument("--dim", type=int, default=64)
    return p.parse_args()


def init_distributed(seed):
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    if seed < 0:
        seed = random.SystemRandom().randint(0, 2 ** 31 - 1)
    seed_t = torch.tensor([seed], dtype=torch.long, device="cuda")
    dist.broadcast(seed_t, src=0)
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    return rank, local_rank, int(seed_t.item())


class SpeechCommandsMFCC(Dataset):
    def __init__(self, root, split, classes, augment=False):
        lists = {}
        for name in ("validation", "testing"):
            with open(os.path.join(root, f"{name}_list.txt")) as f:
                lists[name] = set(f.read().split())
        self.items = []
        for ci, word in enumerate(classes):
            for fname in sorted(os.listdir(os.path.join(root, word))):
                rel = f"{word}/{fname}"
                s = "validation" if rel in lists["validation"] else "testing" if rel in lists["testing"] else "training"
                if s == split:
                    self.items.append((os.path.join(root, rel), ci))
        self.augment = augment
        self.mfcc = torchaudio.transforms.MFCC(16000, n_mfcc=40, melkwargs={"n_fft": 480, "hop_length": 160,
                                                                            "n_mels": 40, "center": True})
        self.masks = nn.Sequential(torchaudio.transforms.TimeMasking(25), torchaudio.transforms.TimeMasking(25),
                                   torchaudio.transforms.FrequencyMasking(7), torchaudio.transforms.FrequencyMasking(7))

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        path, y = self.items[i]
        wav = torchaudio.load(path)[0][0, :16000]
        wav = F.pad(wav, (0, 16000 - wav.numel()))
        if self.augment:
            shift = random.randint(-1600, 1600)
            wav = torch.roll(wav, shift)
            wav = wav * random.uniform(0.7, 1.3)
        x = self.mfcc(wav)  # (40, 101)
        if self.augment:
            x = self.masks(x.unsqueeze(0)).squeeze(0)
        return x, y


class SpatialGatingUnit(nn.Module):
    def __init__(self, dim, seq_len):
        super().__init__()
        self.norm = nn.LayerNorm(dim // 2)
        self.proj = nn.Conv1d(seq_len, seq_len, 1)
        nn.init.zeros_(self.proj.weight)
        nn.init.ones_(self.proj.bias)

    def forward(self, x):
        u, v = x.chunk(2, dim=-1)
        return u * self.proj(self.norm(v))


class GMLPBlock(nn.Module):
    def __init__(self, dim, seq_len, ff_mult=4, drop_path=0.0):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, dim * ff_mult)
        self.sgu = SpatialGatingUnit(dim * ff_mult, seq_len)
        self.fc2 = nn.Linear(dim * ff_mult // 2, dim)
        self.drop_path = drop_path

    def forward(self, x):
        y = self.fc2(self.sgu(F.gelu(self.fc1(self.norm(x)))))
        if self.training and self.drop_path > 0:
            keep = torch.rand(x.size(0), 1, 1, device=x.device) >= self.drop_path
            y = y * keep / (1 - self.drop_path)
        return x + y


class KWMLP(nn.Module):
    def __init__(self, n_classes, n_mfcc=40, seq_len=101, dim=64, depth=12):
        super().__init__()
        self.embed = nn.Linear(n_mfcc, dim)
        self.blocks = nn.Sequential(*[GMLPBlock(dim, seq_len, drop_path=0.1 * i / depth) for i in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, n_classes)

    def forward(self, x):
        x = self.blocks(self.embed(x.transpose(1, 2)))
        return self.head(self.norm(x).mean(1))


def main():
    args = parse_args()
    rank, local_rank, seed = init_distributed(args.seed)
    world = dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(seed)
    random.seed(seed + rank)

    classes = sorted(d for d in os.listdir(args.data)
                     if os.path.isdir(os.path.join(args.data, d)) and not d.startswith("_"))
    train_set = SpeechCommandsMFCC(args.data, "training", classes, augment=True)
    val_set = SpeechCommandsMFCC(args.data, "validation", classes)
    sampler = DistributedSampler(train_set, shuffle=True, seed=seed)
    train_loader = DataLoader(train_set, args.batch_size, sampler=sampler, num_workers=8, pin_memory=True,
                              drop_last=True, persistent_workers=True)
    val_loader = DataLoader(val_set, 512, sampler=DistributedSampler(val_set, shuffle=False), num_workers=8)

    model = DDP(KWMLP(len(classes), dim=args.dim, depth=args.depth).to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    steps = args.epochs * len(train_loader)
    warm = args.warmup_epochs * len(train_loader)
    sched = torch.optim.lr_scheduler.SequentialLR(
        opt, [torch.optim.lr_scheduler.LinearLR(opt, 1e-3, 1.0, total_iters=warm),
              torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps - warm)], milestones=[warm])

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "run.json"), "w") as f:
            json.dump({**vars(args), "seed": seed, "world_size": world, "classes": classes}, f, indent=2)

    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y, label_smoothing=0.1)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()

        model.eval()
        counts = torch.zeros(2, device=device)
        with torch.no_grad():
            for x, y in val_loader:
                x, y = x.to(device), y.to(device)
                counts[0] += (model(x).argmax(-1) == y).sum()
                counts[1] += y.numel()
        dist.all_reduce(counts)
        acc = (counts[0] / counts[1]).item()
        if rank == 0:
            print(f"epoch {epoch:3d} loss {loss.item():.4f} val {acc:.4f} {time.time() - t0:.0f}s", flush=True)
            if acc > best:
                best = acc
                torch.save({"model": model.module.state_dict(), "classes": classes, "seed": seed, "epoch": epoch},
                           os.path.join(args.out, "best.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
