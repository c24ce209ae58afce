"""Continuous Greek Sign Language (GSL, signer-independent split) recognition.

Input: I3D features pre-extracted with a sliding window (stride 4 frames), one .pt file per
sentence video, shape (T', 1024). Model: 2-layer BiLSTM + CTC over the gloss vocabulary.

    torchrun --nproc_per_node=2 01_gsl_continuous_i3d_ctc.py --root /data/GSL --out exp/gsl_si
"""
import argparse
import csv
import os
import time

import editdistance
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence, pad_sequence
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def read_split(path):
    # GSL_SI csv: "<video_path>|<gloss sequence>"
    with open(path, encoding="utf-8") as f:
        return [{"video": r[0], "gloss": r[1].split()} for r in csv.reader(f, delimiter="|")]


def build_vocab(anns):
    glosses = set()
    for a in anns:
        glosses.update(a["gloss"])
    itos = ["<blank>"] + list(glosses)
    return itos, {g: i for i, g in enumerate(itos)}


class GSLFeatures(Dataset):
    def __init__(self, anns, feat_root, stoi, train=False):
        self.anns = anns
        self.feat_root = feat_root
        self.stoi = stoi
        self.train = train

    def __len__(self):
        return len(self.anns)

    def __getitem__(self, i):
        a = self.anns[i]
        feats = torch.load(os.path.join(self.feat_root, a["video"].replace("/", "_") + ".pt"), map_location="cpu")
        if self.train and feats.shape[0] > 8:
            # feature-level dropout of whole time steps
            keep = torch.rand(feats.shape[0]) > 0.1
            feats = feats[keep]
        target = torch.tensor([self.stoi[g] for g in a["gloss"] if g in self.stoi], dtype=torch.long)
        return feats.float(), target


def collate(batch):
    feats, targets = zip(*batch)
    return (pad_sequence(feats, batch_first=True), torch.tensor([len(f) for f in feats]),
            torch.cat(targets), torch.tensor([len(t) for t in targets]))


class BiLSTMCTC(nn.Module):
    def __init__(self, in_dim, vocab_size, hidden=512, layers=2, dropout=0.3):
        super().__init__()
        self.inp = nn.Sequential(nn.Linear(in_dim, hidden), nn.LayerNorm(hidden), nn.ReLU(), nn.Dropout(dropout))
        self.lstm = nn.LSTM(hidden, hidden, layers, batch_first=True, bidirectional=True, dropout=dropout)
        self.out = nn.Linear(2 * hidden, vocab_size)

    def forward(self, x, lens):
        x = self.inp(x)
        packed = pack_padded_sequence(x, lens.cpu(), batch_first=True, enforce_sorted=False)
        h, _ = pad_packed_sequence(self.lstm(packed)[0], batch_first=True, total_length=x.shape[1])
        return self.out(h)


def ctc_greedy(logits, lens):
    hyps = []
    for seq, n in zip(logits.argmax(-1).tolist(), lens.tolist()):
        out, prev = [], 0
        for s in seq[:n]:
            if s != 0 and s != prev:
                out.append(s)
            prev = s
        hyps.append(out)
    return hyps


@torch.no_grad()
def compute_wer(model, loader, device):
    model.eval()
    err = torch.zeros(2, device=device, dtype=torch.float64)
    for x, lens, targets, tlens in loader:
        logits = model(x.to(device), lens.to(device))
        for hyp, ref in zip(ctc_greedy(logits, lens), targets.split(tlens.tolist())):
            err[0] += editdistance.eval(hyp, ref.tolist())
            err[1] += len(ref)
    dist.all_reduce(err)
    return 100.0 * (err[0] / err[1]).item()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--root", default="/data/GSL")
    p.add_argument("--feat-dir", default="features/i3d_s4")
    p.add_argument("--epochs", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--out", default="exp/gsl_si")
    args = p.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1234)

    train_anns = read_split(os.path.join(args.root, "GSL_split", "gsl_split_SI_train.csv"))
    dev_anns = read_split(os.path.join(args.root, "GSL_split", "gsl_split_SI_dev.csv"))
    itos, stoi = build_vocab(train_anns)
    feat_root = os.path.join(args.root, args.feat_dir)

    train_ds = GSLFeatures(train_anns, feat_root, stoi, train=True)
    dev_ds = GSLFeatures(dev_anns, feat_root, stoi)
    train_sampler = DistributedSampler(train_ds, shuffle=True)
    train_dl = DataLoader(train_ds, args.batch_size, sampler=train_sampler, collate_fn=collate,
                          num_workers=4, pin_memory=True, drop_last=True)
    dev_dl = DataLoader(torch.utils.data.Subset(dev_ds, range(rank, len(dev_ds), world_size)), 32,
                        collate_fn=collate, num_workers=2)

    model = DDP(BiLSTMCTC(1024, len(itos)).to(device), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.998), weight_decay=1e-5)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="min", factor=0.5, patience=4)
    ctc_loss = nn.CTCLoss(blank=0, zero_infinity=True)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"{len(itos) - 1} glosses, {len(train_ds)} train / {len(dev_ds)} dev sentences")
    best_wer = float("inf")
    for epoch in range(args.epochs):
        model.train()
        train_sampler.set_epoch(epoch)
        tic, total = time.time(), torch.zeros(2, device=device)
        for x, lens, targets, tlens in train_dl:
            x, lens = x.to(device, non_blocking=True), lens.to(device)
            logits = model(x, lens)
            loss = ctc_loss(logits.log_softmax(-1).transpose(0, 1), targets.to(device), lens, tlens.to(device))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            total += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(total)
        wer = compute_wer(model, dev_dl, device)
        sched.step(wer)  # same WER on every rank after the all-reduce
        if rank == 0:
            print(f"epoch {epoch:2d} loss {(total[0] / total[1]).item():.3f} dev WER {wer:.2f} "
                  f"lr {opt.param_groups[0]['lr']:.1e} {time.time() - tic:.0f}s", flush=True)
            if wer < best_wer:
                best_wer = wer
                torch.save({"model": model.module.state_dict(), "itos": itos, "epoch": epoch, "wer": wer},
                           os.path.join(args.out, "best.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
