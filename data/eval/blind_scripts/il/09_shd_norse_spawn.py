"""Recurrent LIF network (Norse) on SHD, single-node multi-GPU via mp.spawn.

The first hidden layer gets an auxiliary readout for the first few epochs
(deep supervision warm-up); after that only the main readout is trained.

    python 09_shd_norse_spawn.py --h5-dir /data/shd --gpus 4
"""
import argparse
import os
import socket

import h5py
import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from norse.torch import LI, LIFParameters, LIFRecurrent
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

N_UNITS, N_CLASSES = 700, 20


class SHDBinned(Dataset):
    """Bins the spike trains of shd_{train,test}.h5 into [T, 700] count frames."""

    def __init__(self, path, n_bins=250, max_time=1.4):
        with h5py.File(path, "r") as f:
            self.times = [np.asarray(t) for t in f["spikes"]["times"]]
            self.units = [np.asarray(u) for u in f["spikes"]["units"]]
            self.labels = np.asarray(f["labels"], dtype=np.int64)
        self.n_bins, self.max_time = n_bins, max_time

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        tb = np.minimum((self.times[i] / self.max_time * self.n_bins).astype(np.int64), self.n_bins - 1)
        frame = np.zeros((self.n_bins, N_UNITS), dtype=np.float32)
        np.add.at(frame, (tb, self.units[i].astype(np.int64)), 1.0)
        return torch.from_numpy(frame), self.labels[i]


def collate_time_major(batch):
    x = torch.stack([b[0] for b in batch], dim=1)  # [T, B, 700]
    y = torch.as_tensor([b[1] for b in batch])
    return x, y


class RecurrentSNN(nn.Module):
    def __init__(self, hidden=(256, 256), dt=1e-3):
        super().__init__()
        p = LIFParameters(tau_mem_inv=torch.tensor(1 / 20e-3), tau_syn_inv=torch.tensor(1 / 5e-3),
                          alpha=torch.tensor(100.0))
        self.rec1 = LIFRecurrent(N_UNITS, hidden[0], p=p, dt=dt)
        self.rec2 = LIFRecurrent(hidden[0], hidden[1], p=p, dt=dt)
        self.drop = nn.Dropout(0.2)
        self.out = nn.Linear(hidden[1], N_CLASSES)
        self.aux_out = nn.Linear(hidden[0], N_CLASSES)
        self.li = LI(dt=dt)

    def forward(self, x, with_aux=False):
        z1, _ = self.rec1(x)  # state=None -> starts from rest for each batch
        z2, _ = self.rec2(self.drop(z1))
        v, _ = self.li(self.out(self.drop(z2)))
        logits = v.max(0).values
        if with_aux:
            v_aux, _ = self.li(self.aux_out(z1))
            return logits, v_aux.max(0).values
        return logits


@torch.no_grad()
def evaluate(net, loader, device):
    net.eval()
    correct = total = 0
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        correct += (net(x).argmax(1) == y).sum().item()
        total += y.numel()
    return correct / total


def worker(rank, world_size, args):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)
    torch.manual_seed(args.seed)

    train_set = SHDBinned(os.path.join(args.h5_dir, "shd_train.h5"), args.bins)
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, drop_last=True,
                              collate_fn=collate_time_major, num_workers=args.workers, pin_memory=True)

    net = RecurrentSNN().to(device)
    # aux_out is dropped from the graph after the warm-up epochs
    model = DDP(net, device_ids=[rank], find_unused_parameters=True)
    optimizer = torch.optim.Adamax(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=30, gamma=0.5)

    start_epoch, best = 0, 0.0
    ckpt_path = os.path.join(args.out, "last.pt")
    if args.resume and os.path.isfile(ckpt_path):
        state = torch.load(ckpt_path, map_location=device)
        net.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        start_epoch, best = state["epoch"] + 1, state["best"]

    test_loader = None
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        test_set = SHDBinned(os.path.join(args.h5_dir, "shd_test.h5"), args.bins)
        test_loader = DataLoader(test_set, batch_size=256, collate_fn=collate_time_major, num_workers=2)

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        use_aux = epoch < args.aux_epochs
        loss_sum = torch.zeros(2, device=device)
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            if use_aux:
                logits, aux_logits = model(x, with_aux=True)
                loss = F.cross_entropy(logits, y) + args.aux_weight * F.cross_entropy(aux_logits, y)
            else:
                logits = model(x)
                loss = F.cross_entropy(logits, y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            optimizer.step()
            loss_sum += torch.stack([loss.detach() * y.numel(), torch.tensor(float(y.numel()), device=device)])
        scheduler.step()
        dist.all_reduce(loss_sum)

        if rank == 0:
            acc = evaluate(net, test_loader, device)
            best = max(best, acc)
            print(f"epoch {epoch:3d} loss {(loss_sum[0] / loss_sum[1]).item():.4f} "
                  f"test acc {acc:.4f} (best {best:.4f})", flush=True)
            torch.save({"model": net.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "epoch": epoch, "best": best}, ckpt_path)
        dist.barrier()

    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--h5-dir", required=True)
    ap.add_argument("--out", default="runs/shd_norse")
    ap.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    ap.add_argument("--bins", type=int, default=250)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--aux-epochs", type=int, default=10)
    ap.add_argument("--aux-weight", type=float, default=0.3)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--resume", action="store_true")
    args = ap.parse_args()

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    mp.spawn(worker, args=(args.gpus, args), nprocs=args.gpus, join=True)


if __name__ == "__main__":
    main()
