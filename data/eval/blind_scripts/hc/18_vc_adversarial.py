"""Mel-to-mel voice conversion with a speaker-adversarial content bottleneck.

content encoder (mel -> 32-d codes) --GRL--> speaker classifier   (every `adv_every` steps)
codes + target speaker embedding -> decoder -> mel (vocoded later with a pretrained HiFi-GAN)

    python 18_vc_adversarial.py --data data/vctk_mels --out exp/vc_adv --gpus 4
"""
import argparse
import json
import os
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from torch.utils.tensorboard import SummaryWriter


class GradReverse(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, lam):
        ctx.lam = lam
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return -ctx.lam * g, None


class ConvBlock(nn.Module):
    def __init__(self, cin, cout, k=5):
        super().__init__()
        self.conv = nn.Conv1d(cin, cout, k, padding=k // 2)
        self.norm = nn.GroupNorm(1, cout)

    def forward(self, x):
        return F.gelu(self.norm(self.conv(x)))


class VCModel(nn.Module):
    def __init__(self, n_mels, n_speakers, d=256, code_dim=32, spk_dim=128):
        super().__init__()
        self.content = nn.Sequential(ConvBlock(n_mels, d), ConvBlock(d, d), ConvBlock(d, d), nn.Conv1d(d, code_dim, 1))
        self.spk_table = nn.Embedding(n_speakers, spk_dim)
        self.decoder = nn.Sequential(ConvBlock(code_dim + spk_dim, d), ConvBlock(d, d), ConvBlock(d, d),
                                     ConvBlock(d, d), nn.Conv1d(d, n_mels, 1))
        self.spk_clf = nn.Sequential(nn.Conv1d(code_dim, d, 3, padding=1), nn.ReLU(), nn.Conv1d(d, n_speakers, 1))

    def forward(self, mel, spk, adv_lambda=None):
        codes = self.content(mel)
        s = self.spk_table(spk).unsqueeze(-1).expand(-1, -1, codes.size(-1))
        recon = self.decoder(torch.cat([codes, s], dim=1))
        logits = None
        if adv_lambda is not None:
            logits = self.spk_clf(GradReverse.apply(codes, adv_lambda)).mean(-1)
        return recon, logits


class MelSegments(Dataset):
    def __init__(self, items, spk2id, seg_len):
        self.items, self.spk2id, self.seg_len = items, spk2id, seg_len

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        path, spk = self.items[i]
        mel = np.load(path)  # (n_mels, T), log-mel normalised
        if mel.shape[1] < self.seg_len:
            mel = np.pad(mel, ((0, 0), (0, self.seg_len - mel.shape[1])), mode="edge")
        start = random.randint(0, mel.shape[1] - self.seg_len)
        return torch.from_numpy(mel[:, start:start + self.seg_len]).float(), self.spk2id[spk]


def read_split(data_dir, name):
    with open(os.path.join(data_dir, f"{name}.txt")) as f:
        return [tuple(line.strip().split("|")) for line in f if line.strip()]


def train(rank, world_size, args):
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{args.port}", rank=rank, world_size=world_size)
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed)

    train_items, val_items = read_split(args.data, "train"), read_split(args.data, "val")
    speakers = sorted({spk for _, spk in train_items})
    spk2id = {s: i for i, s in enumerate(speakers)}
    val_items = [it for it in val_items if it[1] in spk2id]

    train_set = MelSegments(train_items, spk2id, args.seg_len)
    val_set = MelSegments(val_items, spk2id, args.seg_len)
    sampler = DistributedSampler(train_set, world_size, rank, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=6, pin_memory=True,
                        drop_last=True, persistent_workers=True)
    val_loader = DataLoader(torch.utils.data.Subset(val_set, range(rank, len(val_set), world_size)),
                            batch_size=args.batch_size, num_workers=2)

    model = VCModel(args.n_mels, len(speakers)).to(device)
    # the speaker classifier only runs on adversarial steps
    model = DDP(model, device_ids=[rank], find_unused_parameters=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=1e-4)

    step, epoch = 0, 0
    ckpt_path = os.path.join(args.out, "last.pt")
    if os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, map_location="cpu")
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        step, epoch = ck["step"], ck["epoch"] + 1

    writer = None
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "speakers.json"), "w") as f:
            json.dump(spk2id, f, indent=1)
        writer = SummaryWriter(os.path.join(args.out, "tb"))

    while epoch < args.epochs:
        sampler.set_epoch(epoch)
        model.train()
        for mel, spk in loader:
            mel, spk = mel.to(device, non_blocking=True), spk.to(device, non_blocking=True)
            adv = step >= args.adv_start and step % args.adv_every == 0
            lam = min(1.0, (step - args.adv_start) / 20000) if adv else None
            recon, logits = model(mel, spk, adv_lambda=lam)
            loss_rec = F.l1_loss(recon, mel)
            loss = loss_rec
            if logits is not None:
                loss_adv = F.cross_entropy(logits, spk)
                loss = loss + args.adv_weight * loss_adv
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            step += 1

            if rank == 0 and step % 100 == 0:
                writer.add_scalar("train/recon_l1", loss_rec.item(), step)
                if logits is not None:
                    writer.add_scalar("train/spk_ce", loss_adv.item(), step)
                    writer.add_scalar("train/spk_acc", (logits.argmax(-1) == spk).float().mean().item(), step)

        model.eval()
        totals = torch.zeros(2, device=device)
        with torch.no_grad():
            for mel, spk in val_loader:
                mel, spk = mel.to(device), spk.to(device)
                recon, _ = model.module(mel, spk)
                totals[0] += F.l1_loss(recon, mel, reduction="sum") / mel.size(1) / mel.size(2)
                totals[1] += mel.size(0)
        dist.all_reduce(totals)
        if rank == 0:
            val_l1 = (totals[0] / totals[1].clamp(min=1)).item()
            writer.add_scalar("val/recon_l1", val_l1, step)
            print(f"epoch {epoch} step {step} val recon L1 {val_l1:.4f}")
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "step": step,
                        "epoch": epoch, "speakers": spk2id}, ckpt_path + ".tmp")
            os.replace(ckpt_path + ".tmp", ckpt_path)
        epoch += 1

    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    ap.add_argument("--port", type=int, default=29650)
    ap.add_argument("--n_mels", type=int, default=80)
    ap.add_argument("--seg_len", type=int, default=128)
    ap.add_argument("--batch_size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--epochs", type=int, default=500)
    ap.add_argument("--adv_start", type=int, default=10000)
    ap.add_argument("--adv_every", type=int, default=2)
    ap.add_argument("--adv_weight", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args()
    mp.spawn(train, args=(args.gpus, args), nprocs=args.gpus, join=True)


if __name__ == "__main__":
    main()
