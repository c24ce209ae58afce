"""Per-residue secondary structure (Q8 / Q3) from frozen protein LM embeddings (ProtT5 / ESM-2).

Embeddings are precomputed into an HDF5 file, one dataset per protein id, shape (L, 1024).
Labels come from a NetSurfP-style CSV (id, sequence, dssp8).

    torchrun --nproc_per_node=4 10_protein_ss8_cnn_lstm.py --emb data/prott5_train.h5 --labels data/train.csv
"""
import argparse
import logging
import os
import time

import h5py
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

DSSP8 = "GHIBESTC"
Q8_TO_Q3 = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2])  # GHI->H, BE->E, STC->C


class EmbeddingSS(Dataset):
    def __init__(self, h5_path, csv_path, max_len=1000):
        self.h5_path = h5_path
        df = pd.read_csv(csv_path)
        df = df[df["sequence"].str.len() <= max_len].reset_index(drop=True)
        self.ids = df["id"].tolist()
        self.labels = [torch.tensor([DSSP8.index(c) for c in s]) for s in df["dssp8"]]
        self._h5 = None

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        if self._h5 is None:
            self._h5 = h5py.File(self.h5_path, "r")
        emb = torch.from_numpy(self._h5[self.ids[i]][()]).float()
        return emb, self.labels[i]


def pad_batch(batch):
    embs, labs = zip(*batch)
    lengths = torch.tensor([e.shape[0] for e in embs])
    x = pad_sequence(embs, batch_first=True)
    y = pad_sequence(labs, batch_first=True, padding_value=-100)
    return x, y, lengths


class SSPredictor(nn.Module):
    def __init__(self, d_in=1024, d_conv=256, d_lstm=256, dropout=0.25):
        super().__init__()
        self.proj = nn.Sequential(nn.Dropout(dropout), nn.Conv1d(d_in, d_conv, 1), nn.ReLU())
        self.convs = nn.ModuleList([nn.Conv1d(d_conv, d_conv // 2, k, padding=k // 2) for k in (3, 9, 15)])
        self.lstm = nn.LSTM(d_conv + 3 * (d_conv // 2), d_lstm, num_layers=2, batch_first=True,
                            bidirectional=True, dropout=dropout)
        self.head_q8 = nn.Linear(2 * d_lstm, 8)
        self.head_q3 = nn.Linear(2 * d_lstm, 3)

    def forward(self, x, lengths):
        h = self.proj(x.transpose(1, 2))
        h = torch.cat([h] + [F.relu(c(h)) for c in self.convs], 1).transpose(1, 2)
        packed = nn.utils.rnn.pack_padded_sequence(h, lengths.cpu(), batch_first=True, enforce_sorted=False)
        out, _ = self.lstm(packed)
        out, _ = nn.utils.rnn.pad_packed_sequence(out, batch_first=True, total_length=x.shape[1])
        return self.head_q8(out), self.head_q3(out)


def loss_fn(q8, q3, y):
    y3 = torch.where(y >= 0, Q8_TO_Q3.to(y.device)[y.clamp(min=0)], torch.full_like(y, -100))
    return F.cross_entropy(q8.transpose(1, 2), y, ignore_index=-100) + \
        F.cross_entropy(q3.transpose(1, 2), y3, ignore_index=-100)


@torch.no_grad()
def evaluate(net, loader, device):
    net.eval()
    c = torch.zeros(3, device=device, dtype=torch.long)  # correct q8, correct q3, residues
    lut = Q8_TO_Q3.to(device)
    for x, y, lengths in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        q8, q3 = net(x, lengths)
        m = y >= 0
        c[0] += (q8.argmax(-1)[m] == y[m]).sum()
        c[1] += (q3.argmax(-1)[m] == lut[y[m]]).sum()
        c[2] += m.sum()
    dist.all_reduce(c)
    net.train()
    return c[0].item() / c[2].item(), c[1].item() / c[2].item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--emb", required=True)
    ap.add_argument("--labels", required=True)
    ap.add_argument("--val-emb", default="data/prott5_casp12.h5")
    ap.add_argument("--val-labels", default="data/casp12.csv")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--out", default="checkpoints/ss8")
    ap.add_argument("--resume", action="store_true")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s [rank{rank}] %(message)s")
    log = logging.getLogger("ss8")
    if rank != 0:
        log.setLevel(logging.WARNING)

    train_ds = EmbeddingSS(args.emb, args.labels)
    val_ds = EmbeddingSS(args.val_emb, args.val_labels)
    sampler = DistributedSampler(train_ds, shuffle=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, collate_fn=pad_batch,
                          num_workers=4, pin_memory=True)
    val_dl = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), batch_size=32,
                        collate_fn=pad_batch, num_workers=2)

    net = SSPredictor().to(device)
    os.makedirs(args.out, exist_ok=True)
    last_path = os.path.join(args.out, "last.pt")
    best_path = os.path.join(args.out, "best.pt")
    start_epoch, best_q3 = 0, 0.0
    opt_state = None
    if args.resume and os.path.exists(last_path):
        ck = torch.load(last_path, map_location=device)
        net.load_state_dict(ck["model"])
        opt_state = ck["optimizer"]
        start_epoch, best_q3 = ck["epoch"] + 1, ck["best_q3"]
        log.info("resumed from epoch %d (best Q3 %.4f)", ck["epoch"], best_q3)

    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    if opt_state is not None:
        opt.load_state_dict(opt_state)

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        run = torch.zeros(2, device=device)
        for x, y, lengths in train_dl:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            q8, q3 = model(x, lengths)
            loss = loss_fn(q8, q3, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            run[0] += loss.detach()
            run[1] += 1
        dist.all_reduce(run)
        q8_acc, q3_acc = evaluate(net, val_dl, device)
        log.info("epoch %d loss %.4f | CASP12 Q8 %.4f Q3 %.4f | %.0fs",
                 epoch, (run[0] / run[1]).item(), q8_acc, q3_acc, time.time() - t0)
        if rank == 0:
            state = {"model": model.state_dict(), "optimizer": opt.state_dict(),
                     "epoch": epoch, "best_q3": max(best_q3, q3_acc)}
            torch.save(state, last_path)
            if q3_acc > best_q3:
                torch.save(state, best_path)
        best_q3 = max(best_q3, q3_acc)
        dist.barrier()

    # final evaluation with the best weights
    best = SSPredictor().to(device)
    best.load_state_dict(torch.load(best_path, map_location=device)["model"])
    q8_acc, q3_acc = evaluate(best, val_dl, device)
    log.info("best checkpoint: Q8 %.4f Q3 %.4f", q8_acc, q3_acc)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
