"""Chord-conditioned melody generation (Hooktheory lead sheets).

Each song is a 16th-note grid; every step has a chord label (root * 12 qualities) and a
melody event (rest / hold / onset of pitch 48..95). The decoder predicts the melody event
for step t from all chords up to t and all melody events before t.

    torchrun --nproc_per_node=4 20_chord_to_melody.py --data /data/hooktheory/songs.jsonl --wandb_project chord2mel
"""
import argparse
import json
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

N_CHORDS = 12 * 12 + 1  # 12 roots x 12 qualities + no-chord
REST, HOLD, LOW_PITCH, N_PITCH = 0, 1, 48, 48
N_MEL = 2 + N_PITCH
MEL_BOS = N_MEL
MEL_PAD = N_MEL + 1


class LeadSheets(Dataset):
    def __init__(self, songs, steps, train):
        self.songs, self.steps, self.train = songs, steps, train

    def __len__(self):
        return len(self.songs)

    def __getitem__(self, i):
        s = self.songs[i]
        chords = np.asarray(s["chords"], dtype=np.int64)
        mel = np.asarray(s["melody"], dtype=np.int64)
        if self.train:
            # random transposition: roll chord roots and melody pitches together
            k = np.random.randint(-6, 6)
            has_root = chords < 144
            chords = np.where(has_root, ((chords // 12 + k) % 12) * 12 + chords % 12, chords)
            is_note = mel >= 2
            shifted = mel + k
            ok = (shifted >= 2) & (shifted < N_MEL)
            mel = np.where(is_note & ok, shifted, mel)
        L = len(mel)
        st = np.random.randint(0, max(1, L - self.steps + 1)) if self.train else 0
        c = np.full(self.steps, N_CHORDS - 1, dtype=np.int64)
        m = np.full(self.steps, MEL_PAD, dtype=np.int64)
        c[:min(self.steps, L - st)] = chords[st:st + self.steps]
        m[:min(self.steps, L - st)] = mel[st:st + self.steps]
        return torch.from_numpy(c), torch.from_numpy(m)


class Chord2Melody(nn.Module):
    def __init__(self, d=512, layers=8, heads=8, steps=512):
        super().__init__()
        self.chord = nn.Embedding(N_CHORDS, d)
        self.mel = nn.Embedding(N_MEL + 2, d)
        self.pos = nn.Embedding(steps, d)
        self.metric = nn.Embedding(16, d)  # position in the bar
        layer = nn.TransformerEncoderLayer(d, heads, 4 * d, 0.1, batch_first=True, norm_first=True)
        self.body = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d)
        self.out = nn.Linear(d, N_MEL)

    def forward(self, chords, mel):
        B, T = mel.shape
        prev = torch.cat([torch.full((B, 1), MEL_BOS, device=mel.device, dtype=mel.dtype), mel[:, :-1]], 1)
        t = torch.arange(T, device=mel.device)
        h = self.chord(chords) + self.mel(prev) + self.pos(t) + self.metric(t % 16)
        mask = nn.Transformer.generate_square_subsequent_mask(T, device=mel.device)
        return self.out(self.norm(self.body(h, mask=mask, is_causal=True)))


def load_songs(path):
    with open(path) as f:
        songs = [json.loads(l) for l in f]
    train = [s for s in songs if s["split"] == "train"]
    valid = [s for s in songs if s["split"] == "valid"]
    return train, valid


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    acc = torch.zeros(3, device=device, dtype=torch.float64)
    for c, m in loader:
        c, m = c.to(device), m.to(device)
        logits = model(c, m)
        valid = m != MEL_PAD
        acc[0] += F.cross_entropy(logits.transpose(1, 2), m.masked_fill(~valid, -100), ignore_index=-100,
                                  reduction="sum")
        acc[1] += ((logits.argmax(-1) == m) & valid).sum()
        acc[2] += valid.sum()
    dist.all_reduce(acc)
    model.train()
    return (acc[0] / acc[2]).item(), (acc[1] / acc[2]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", default="runs/chord2mel")
    ap.add_argument("--steps", type=int, default=512)
    ap.add_argument("--batch_size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--epochs", type=int, default=80)
    ap.add_argument("--warmup", type=int, default=1000)
    ap.add_argument("--wandb_project", default="chord2mel")
    ap.add_argument("--run_name", default=None)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(3)

    run = wandb.init(project=args.wandb_project, name=args.run_name, config=vars(args))
    run.config.update({"world_size": world, "global_batch": args.batch_size * world})

    train_songs, valid_songs = load_songs(args.data)
    train_ds = LeadSheets(train_songs, args.steps, train=True)
    valid_ds = LeadSheets(valid_songs[rank::world], args.steps, train=False)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=4,
                          pin_memory=True, drop_last=True)
    valid_dl = DataLoader(valid_ds, batch_size=args.batch_size, num_workers=2)

    net = Chord2Melody(steps=args.steps).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    total = args.epochs * len(train_dl)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / args.warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / total))))

    os.makedirs(args.out, exist_ok=True)
    step, best_acc = 0, 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for c, m in train_dl:
            c, m = c.to(device, non_blocking=True), m.to(device, non_blocking=True)
            logits = model(c, m)
            loss = F.cross_entropy(logits.transpose(1, 2), m.masked_fill(m == MEL_PAD, -100), ignore_index=-100)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1
            if step % 25 == 0:
                wandb.log({"train/loss": loss.item(), "train/lr": sched.get_last_lr()[0]}, step=step)

        v_loss, v_acc = evaluate(net, valid_dl, device)
        wandb.log({"valid/loss": v_loss, "valid/acc": v_acc, "epoch": epoch,
                   "epoch_time_s": time.time() - t0}, step=step)
        if rank == 0:
            print(f"epoch {epoch} valid loss {v_loss:.4f} acc {v_acc:.4f}", flush=True)
            torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "epoch": epoch},
                       os.path.join(args.out, "last.pt"))
            if v_acc > best_acc:
                best_acc = v_acc
                torch.save({"model": net.state_dict(), "epoch": epoch}, os.path.join(args.out, "best.pt"))
        dist.barrier()

    wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
