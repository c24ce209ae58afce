"""Attention-RNN KWS (de Andrade et al., 2018) with Weights & Biases tracking.

    torchrun --nproc_per_node=4 14_attrnn_wandb.py --data /data/speech_commands_v0.02 \
        --wandb-project kws-attrnn --run-name attrnn_bs4x128
"""
import argparse
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchaudio.datasets import SPEECHCOMMANDS

LABELS = sorted(["backward", "bed", "bird", "cat", "dog", "down", "eight", "five", "follow", "forward", "four",
                 "go", "happy", "house", "learn", "left", "marvin", "nine", "no", "off", "on", "one", "right",
                 "seven", "sheila", "six", "stop", "three", "tree", "two", "up", "visual", "wow", "yes", "zero"])
LABEL2IDX = {w: i for i, w in enumerate(LABELS)}


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True, help="parent folder of SpeechCommands/")
    p.add_argument("--wandb-project", default="kws-attrnn")
    p.add_argument("--run-name", default=None)
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--lr-decay", type=float, default=0.4)
    p.add_argument("--decay-every", type=int, default=10)
    p.add_argument("--noise-prob", type=float, default=0.7)
    p.add_argument("--ckpt-dir", default="checkpoints/attrnn")
    p.add_argument("--seed", type=int, default=2024)
    return p.parse_args()


class Collator:
    def __init__(self, noise_clips, noise_prob, train):
        self.noise = noise_clips
        self.noise_prob = noise_prob
        self.train = train

    def __call__(self, batch):
        wavs, ys = [], []
        for wav, sr, label, *_ in batch:
            wav = wav[0, :16000]
            wav = F.pad(wav, (0, 16000 - wav.numel()))
            if self.train and random.random() < self.noise_prob:
                n = random.choice(self.noise)
                o = random.randint(0, n.numel() - 16000)
                wav = wav + random.uniform(0.0, 0.2) * n[o:o + 16000]
            wavs.append(wav)
            ys.append(LABEL2IDX[label])
        return torch.stack(wavs), torch.tensor(ys)


class AttRNN(nn.Module):
    def __init__(self, n_classes, n_mels=80):
        super().__init__()
        self.mel = torchaudio.transforms.MelSpectrogram(16000, n_fft=1024, hop_length=128, n_mels=n_mels)
        self.conv = nn.Sequential(nn.Conv2d(1, 10, (5, 1), padding=(2, 0)), nn.BatchNorm2d(10), nn.ReLU(),
                                  nn.Conv2d(10, 1, (5, 1), padding=(2, 0)), nn.BatchNorm2d(1), nn.ReLU())
        self.rnn = nn.LSTM(n_mels, 64, num_layers=2, batch_first=True, bidirectional=True)
        self.query = nn.Linear(128, 128)
        self.head = nn.Sequential(nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 32), nn.Linear(32, n_classes))

    def forward(self, wav):
        x = (self.mel(wav) + 1e-6).log().transpose(1, 2).unsqueeze(1)  # B,1,T,F
        x = self.conv(x).squeeze(1)
        seq, _ = self.rnn(x)
        q = self.query(seq[:, seq.size(1) // 2])
        att = torch.softmax(torch.einsum("btd,bd->bt", seq, q), dim=1)
        ctx = torch.einsum("bt,btd->bd", att, seq)
        return self.head(ctx)


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed)

    run = wandb.init(project=args.wandb_project, name=args.run_name,
                     config={**vars(args), "world_size": world, "global_batch": args.batch_size * world})

    if rank == 0:
        SPEECHCOMMANDS(args.data, download=True)
    dist.barrier()
    train_set = SPEECHCOMMANDS(args.data, subset="training")
    val_set = SPEECHCOMMANDS(args.data, subset="validation")
    noise_dir = os.path.join(train_set._path, "_background_noise_")
    noise = [torchaudio.load(os.path.join(noise_dir, f))[0][0] for f in sorted(os.listdir(noise_dir))
             if f.endswith(".wav")]

    train_sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_set, args.batch_size, sampler=train_sampler, num_workers=8, pin_memory=True,
                              collate_fn=Collator(noise, args.noise_prob, True), drop_last=True)
    val_loader = DataLoader(val_set, 256, sampler=DistributedSampler(val_set, shuffle=False), num_workers=8,
                            collate_fn=Collator(noise, 0.0, False))

    model = DDP(AttRNN(len(LABELS)).to(device), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.StepLR(opt, args.decay_every, gamma=args.lr_decay)
    run.watch(model, log="gradients", log_freq=500)

    best, global_step = 0.0, 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for wav, y in train_loader:
            wav, y = wav.to(device, non_blocking=True), y.to(device, non_blocking=True)
            logits = model(wav)
            loss = F.cross_entropy(logits, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            global_step += 1
            if global_step % 50 == 0:
                acc = (logits.argmax(1) == y).float().mean()
                run.log({"train/loss": loss.item(), "train/acc": acc.item(),
                         "lr": sched.get_last_lr()[0]}, step=global_step)
        sched.step()

        model.eval()
        tot = torch.zeros(3, device=device)
        with torch.no_grad():
            for wav, y in val_loader:
                wav, y = wav.to(device), y.to(device)
                logits = model(wav)
                tot[0] += F.cross_entropy(logits, y, reduction="sum")
                tot[1] += (logits.argmax(1) == y).sum()
                tot[2] += y.numel()
        dist.all_reduce(tot)
        val_loss, val_acc = (tot[0] / tot[2]).item(), (tot[1] / tot[2]).item()
        run.log({"val/loss": val_loss, "val/acc": val_acc, "epoch": epoch,
                 "epoch_time_s": time.time() - t0}, step=global_step)

        if rank == 0 and val_acc > best:
            best = val_acc
            os.makedirs(args.ckpt_dir, exist_ok=True)
            path = os.path.join(args.ckpt_dir, "best.pt")
            torch.save({"model": model.module.state_dict(), "labels": LABELS, "val_acc": val_acc}, path)
            run.summary["best_val_acc"] = best

    run.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
