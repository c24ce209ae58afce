"""ECAPA-TDNN with a softmax warm-up stage followed by AAM-softmax.

The first `--softmax-epochs` epochs train the encoder with a plain linear
softmax classifier (converges faster from scratch on noisy in-the-wild data),
after which training switches to the AAM-softmax head for the remaining epochs.

    torchrun --standalone --nproc_per_node=4 14_ecapa_softmax_pretrain_aam.py \
        --train data/vox2_dev/train.tsv --exp exp/ecapa_sm2aam
"""
import argparse
import math
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
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

from model.ecapa import ECAPA_TDNN
from model.features import MelFbank
from utils.eval import eer_and_dcf, load_trials


class AAMHead(nn.Module):
    def __init__(self, dim, n_spk, m=0.2, s=30.0):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_spk, dim) * 0.01)
        self.m, self.s = m, s

    def forward(self, emb, y):
        cos = F.linear(F.normalize(emb), F.normalize(self.weight)).clamp(-1 + 1e-7, 1 - 1e-7)
        target = torch.cos(torch.acos(cos.gather(1, y[:, None])) + self.m)
        logits = cos.scatter(1, y[:, None], target) * self.s
        return logits


class SpeakerNet(nn.Module):
    def __init__(self, n_spk, emb_dim=192):
        super().__init__()
        self.feat = MelFbank(n_mels=80)
        self.encoder = ECAPA_TDNN(in_channels=80, channels=1024, emb_dim=emb_dim)
        self.softmax_head = nn.Linear(emb_dim, n_spk)
        self.aam_head = AAMHead(emb_dim, n_spk)

    def embed(self, wav):
        return self.encoder(self.feat(wav))

    def forward(self, wav, y, use_aam):
        emb = self.embed(wav)
        logits = self.aam_head(emb, y) if use_aam else self.softmax_head(emb)
        return logits


class TsvCrops(Dataset):
    def __init__(self, tsv, seconds):
        rows = [l.rstrip("\n").split("\t") for l in open(tsv)]  # path, speaker, n_samples
        self.spk2id = {s: i for i, s in enumerate(sorted({r[1] for r in rows}))}
        self.rows = [(r[0], self.spk2id[r[1]], int(r[2])) for r in rows]
        self.n = int(seconds * 16000)

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        path, y, total = self.rows[i]
        off = random.randint(0, max(0, total - self.n))
        wav, _ = sf.read(path, start=off, frames=self.n, dtype="float32")
        if len(wav) < self.n:
            wav = np.pad(wav, (0, self.n - len(wav)), mode="wrap")
        return torch.from_numpy(wav), y


@torch.no_grad()
def evaluate(net, trials, wav_dir, device, rank, world):
    net.eval()
    utts = sorted({u for _, a, b in trials for u in (a, b)})
    emb = {}
    for u in utts[rank::world]:
        wav, _ = sf.read(os.path.join(wav_dir, u), dtype="float32")
        emb[u] = F.normalize(net.embed(torch.from_numpy(wav)[None].to(device)), dim=-1)[0].cpu()
    parts = [None] * world
    dist.all_gather_object(parts, emb)
    for p in parts:
        emb.update(p)
    scores = np.array([float(emb[a] @ emb[b]) for _, a, b in trials])
    labels = np.array([lab for lab, _, _ in trials])
    return eer_and_dcf(scores, labels)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", required=True)
    ap.add_argument("--trials", default="data/vox1/veri_test2.txt")
    ap.add_argument("--vox1", default="data/vox1/wav")
    ap.add_argument("--exp", required=True)
    ap.add_argument("--epochs", type=int, default=60)
    ap.add_argument("--softmax-epochs", type=int, default=4)
    ap.add_argument("--global-batch", type=int, default=512)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seconds", type=float, default=2.0)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    data = TsvCrops(args.train, args.seconds)
    sampler = DistributedSampler(data, shuffle=True, drop_last=True)
    loader = DataLoader(data, batch_size=args.global_batch // world, sampler=sampler,
                        num_workers=8, pin_memory=True, drop_last=True)
    trials = load_trials(args.trials)

    net = SpeakerNet(len(data.spk2id)).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=5e-5)
    total_steps = args.epochs * len(loader)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=total_steps, pct_start=0.05,
                                                anneal_strategy="cos")

    writer = SummaryWriter(os.path.join(args.exp, "tb")) if rank == 0 else None
    best = math.inf
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        use_aam = epoch >= args.softmax_epochs
        model.train()
        t0 = time.time()
        acc_sum = torch.zeros(3, device=device)
        for step, (wav, y) in enumerate(loader):
            wav, y = wav.to(device, non_blocking=True), y.to(device, non_blocking=True)
            logits = model(wav, y, use_aam)
            loss = F.cross_entropy(logits, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            acc_sum += torch.stack([loss.detach(), (logits.argmax(1) == y).float().mean(),
                                    torch.ones((), device=device)])
        dist.all_reduce(acc_sum)
        tr_loss, tr_acc = (acc_sum[0] / acc_sum[2]).item(), (acc_sum[1] / acc_sum[2]).item()

        eer, dcf = evaluate(net, trials, args.vox1, device, rank, world)
        if rank == 0:
            head = "aam" if use_aam else "softmax"
            print(f"epoch {epoch} [{head}] loss {tr_loss:.4f} acc {tr_acc:.3f} EER {eer:.3f}% "
                  f"minDCF {dcf:.4f} ({time.time() - t0:.0f}s)", flush=True)
            writer.add_scalar("train/loss", tr_loss, epoch)
            writer.add_scalar("eval/eer", eer, epoch)
            ckpt = {"model": net.state_dict(), "opt": opt.state_dict(), "epoch": epoch, "spk2id": data.spk2id}
            torch.save(ckpt, os.path.join(args.exp, "last.pt"))
            if eer < best:
                best = eer
                torch.save(ckpt, os.path.join(args.exp, "best.pt"))
        dist.barrier()

    if writer:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
