#!/usr/bin/env python
# Multilingual phone recognizer (BiGRU-CTC) on Common Voice phone transcriptions.
# Launched directly by srun, one task per GPU:
#
#   sbatch -N 2 --ntasks-per-node=4 --gres=gpu:4 --cpus-per-task=8 -t 48:00:00 \
#       --wrap "srun python 18_phone_ctc_slurm.py --data /data/cv_phones --exp exp/phone_ctc"
import argparse
import os
import subprocess
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter


def init_distributed_slurm():
    rank = int(os.environ["SLURM_PROCID"])
    world_size = int(os.environ["SLURM_NTASKS"])
    local_rank = int(os.environ["SLURM_LOCALID"])
    if "MASTER_ADDR" not in os.environ:
        nodes = subprocess.check_output(["scontrol", "show", "hostnames", os.environ["SLURM_JOB_NODELIST"]])
        os.environ["MASTER_ADDR"] = nodes.decode().split()[0]
    os.environ.setdefault("MASTER_PORT", str(15000 + int(os.environ["SLURM_JOB_ID"]) % 10000))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", init_method="env://", rank=rank, world_size=world_size)
    return rank, world_size, local_rank


class PhoneDataset(Dataset):
    def __init__(self, data_dir, split, phone2id):
        self.items = []
        with open(os.path.join(data_dir, f"{split}.tsv"), encoding="utf-8") as f:
            for line in f:
                feat, lang, phones = line.rstrip("\n").split("\t")
                self.items.append((os.path.join(data_dir, feat), [phone2id[p] for p in phones.split()]))

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        feat, ph = self.items[i]
        x = np.load(feat).astype(np.float32)
        x = (x - x.mean(0)) / (x.std(0) + 1e-5)
        return torch.from_numpy(x), torch.tensor(ph)


def collate(batch):
    xs, ys = zip(*batch)
    return (nn.utils.rnn.pad_sequence(xs, batch_first=True), torch.tensor([len(x) for x in xs]),
            torch.cat(ys), torch.tensor([len(y) for y in ys]))


class BiGRUCTC(nn.Module):
    def __init__(self, idim, n_phones, hidden=384, layers=5):
        super().__init__()
        self.front = nn.Sequential(nn.Linear(idim * 3, hidden), nn.ReLU(), nn.Dropout(0.1))
        self.gru = nn.GRU(hidden, hidden, layers, batch_first=True, bidirectional=True, dropout=0.2)
        self.head = nn.Linear(2 * hidden, n_phones + 1)

    def forward(self, x, lens):
        # stack 3 frames -> 30 ms frame rate
        T = x.size(1) // 3 * 3
        x = x[:, :T].reshape(x.size(0), T // 3, -1)
        lens = torch.clamp(lens // 3, min=1)
        x = self.front(x)
        x = nn.utils.rnn.pack_padded_sequence(x, lens.cpu(), batch_first=True, enforce_sorted=False)
        h, _ = self.gru(x)
        h, _ = nn.utils.rnn.pad_packed_sequence(h, batch_first=True, total_length=T // 3)
        return self.head(h).log_softmax(-1), lens


def per_counts(logp, lens, ys, ylens):
    """phone error counts with greedy decoding"""
    import editdistance
    best = logp.argmax(-1).cpu()
    refs = torch.split(ys.cpu(), ylens.cpu().tolist())
    errs = 0
    for b in range(best.size(0)):
        seq = torch.unique_consecutive(best[b, : lens[b]])
        seq = seq[seq != 0].tolist()
        errs += editdistance.eval(seq, refs[b].tolist())
    return errs, int(ylens.sum())


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    s = torch.zeros(4, device=device, dtype=torch.float64)
    for x, xl, y, yl in loader:
        x, xl, y, yl = x.to(device), xl.to(device), y.to(device), yl.to(device)
        logp, ol = model(x, xl)
        s[0] += F.ctc_loss(logp.transpose(0, 1), y, ol, yl, zero_infinity=True, reduction="sum").double()
        s[1] += x.size(0)
        e, n = per_counts(logp, ol, y, yl)
        s[2] += e
        s[3] += n
    dist.all_reduce(s)
    model.train()
    return (s[0] / s[1]).item(), (100 * s[2] / s[3]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--exp", required=True)
    ap.add_argument("--bs", type=int, default=48)
    ap.add_argument("--epochs", type=int, default=60)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--patience", type=int, default=5)
    args = ap.parse_args()

    rank, world, local_rank = init_distributed_slurm()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    phones = [l.split()[0] for l in open(os.path.join(args.data, "phones.txt"), encoding="utf-8")]
    phone2id = {p: i + 1 for i, p in enumerate(phones)}
    train_set = PhoneDataset(args.data, "train", phone2id)
    dev_set = PhoneDataset(args.data, "dev", phone2id)
    train_sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True, drop_last=True)
    workers = max(1, int(os.environ.get("SLURM_CPUS_PER_TASK", 4)) - 1)
    train_loader = DataLoader(train_set, batch_size=args.bs, sampler=train_sampler, collate_fn=collate,
                              num_workers=workers, pin_memory=True, drop_last=True)
    dev_loader = DataLoader(torch.utils.data.Subset(dev_set, range(rank, len(dev_set), world)),
                            batch_size=64, collate_fn=collate, num_workers=2)

    model = BiGRUCTC(80, len(phones)).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=1)

    start_epoch, best_per, bad = 0, 1e9, 0
    resume = os.path.join(args.exp, "last.pt")
    if os.path.isfile(resume):
        ck = torch.load(resume, map_location="cpu")
        model.module.load_state_dict(ck["model"])
        optimizer.load_state_dict(ck["optim"])
        scheduler.load_state_dict(ck["sched"])
        start_epoch, best_per, bad = ck["epoch"] + 1, ck["best_per"], ck["bad"]

    writer = None
    if rank == 0:
        os.makedirs(args.exp, exist_ok=True)
        writer = SummaryWriter(os.path.join(args.exp, "tb"))
        print(f"world={world} master={os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']} "
              f"phones={len(phones)} train={len(train_set)}", flush=True)

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        for i, (x, xl, y, yl) in enumerate(train_loader):
            x, xl, y, yl = x.to(device), xl.to(device), y.to(device), yl.to(device)
            logp, ol = model(x, xl)
            loss = F.ctc_loss(logp.transpose(0, 1), y, ol, yl, zero_infinity=True)
            optimizer.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            optimizer.step()
            if writer and i % 100 == 0:
                writer.add_scalar("train/ctc", loss.item(), epoch * len(train_loader) + i)

        dev_loss, dev_per = evaluate(model.module, dev_loader, device)
        scheduler.step(dev_loss)
        if dev_per < best_per:
            best_per, bad = dev_per, 0
        else:
            bad += 1
        if rank == 0:
            print(f"epoch {epoch} dev loss {dev_loss:.3f} PER {dev_per:.2f} ({time.time() - t0:.0f}s)", flush=True)
            writer.add_scalar("dev/per", dev_per, epoch)
            ck = {"model": model.module.state_dict(), "optim": optimizer.state_dict(),
                  "sched": scheduler.state_dict(), "epoch": epoch, "best_per": best_per, "bad": bad}
            torch.save(ck, resume + ".tmp")
            os.replace(resume + ".tmp", resume)
            if bad == 0:
                torch.save(model.module.state_dict(), os.path.join(args.exp, "best.pt"))
        dist.barrier()
        if bad >= args.patience:
            break

    if writer:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
