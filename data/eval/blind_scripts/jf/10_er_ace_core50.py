"""ER-ACE (Caccia et al., ICLR 2022) on CORe50-NC with per-task early stopping.

CORe50 NC protocol: 50 objects, first task 10 objects, then 8 tasks of 5.
Train sessions: all but s3, s7, s10 (test). 10% of every task's training
images is held out to decide when to stop training on that task.

    torchrun --nproc_per_node=8 10_er_ace_core50.py --root /datasets/core50_128x128
"""
import argparse
import glob
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import models, transforms

TEST_SESSIONS = (3, 7, 10)


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="/datasets/core50_128x128")
    ap.add_argument("--out", default="./runs/erace_core50")
    ap.add_argument("--pretrained", default="/models/torchvision/resnet18-f37072fd.pth")
    ap.add_argument("--max-epochs", type=int, default=30)
    ap.add_argument("--patience", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=16, help="incoming batch per GPU")
    ap.add_argument("--mem-batch", type=int, default=16)
    ap.add_argument("--mem-per-rank", type=int, default=1000)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=6)
    return ap.parse_args()


class Core50(Dataset):
    def __init__(self, files, labels, tf):
        self.files, self.labels, self.tf = files, labels, tf

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        img = Image.open(self.files[i]).convert("RGB")
        return self.tf(img), self.labels[i]


def scan(root, sessions):
    files, labels = [], []
    for s in sessions:
        for o in range(1, 51):
            fs = sorted(glob.glob(os.path.join(root, f"s{s}", f"o{o}", "*.png")))
            files += fs
            labels += [o - 1] * len(fs)
    return np.array(files), np.array(labels)


class Memory:
    def __init__(self, size, device):
        self.size, self.device = size, device
        self.x = self.y = None
        self.seen = 0

    def add(self, x, y):
        if self.x is None:
            self.x = torch.empty((self.size, *x.shape[1:]), device=self.device)
            self.y = torch.empty(self.size, dtype=torch.long, device=self.device)
        for i in range(len(y)):
            j = self.seen if self.seen < self.size else int(torch.randint(0, self.seen + 1, (1,)))
            if j < self.size:
                self.x[j], self.y[j] = x[i], y[i]
            self.seen += 1

    def sample(self, n):
        k = min(self.seen, self.size)
        idx = torch.randint(0, k, (n,), device=self.device)
        return self.x[idx], self.y[idx]


def ace_loss(logits, y):
    # asymmetric CE: incoming data only competes among the classes present in the batch
    present = y.unique()
    mask = torch.zeros_like(logits, dtype=torch.bool)
    mask[:, present] = True
    return F.cross_entropy(logits.masked_fill(~mask, -1e9), y)


@torch.no_grad()
def accuracy(net, loader, device):
    net.eval()
    c = n = 0
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        c += (net(x).argmax(1) == y).sum().item()
        n += y.numel()
    net.train()
    return c / max(n, 1)


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(args.seed + rank)

    norm = transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train_tf = transforms.Compose([transforms.RandomResizedCrop(128, scale=(0.7, 1.0)),
                                   transforms.RandomHorizontalFlip(), transforms.ToTensor(), norm])
    test_tf = transforms.Compose([transforms.ToTensor(), norm])
    tr_files, tr_labels = scan(args.root, [s for s in range(1, 12) if s not in TEST_SESSIONS])
    te_files, te_labels = scan(args.root, TEST_SESSIONS)

    obj_order = np.random.RandomState(args.seed).permutation(50)
    tasks = [obj_order[:10]] + [obj_order[10 + 5 * k: 15 + 5 * k] for k in range(8)]

    net = models.resnet18()
    if args.pretrained:
        net.load_state_dict(torch.load(args.pretrained, map_location="cpu"))
    net.fc = nn.Linear(512, 50)
    net = net.to(device)
    model = DDP(net, device_ids=[local_rank])
    memory = Memory(args.mem_per_rank, device)
    acc_hist = []

    for t, objs in enumerate(tasks):
        sel = np.where(np.isin(tr_labels, objs))[0]
        sel = np.random.RandomState(args.seed + t).permutation(sel)
        n_val = len(sel) // 10
        val_ds = Core50(tr_files[sel[:n_val]], tr_labels[sel[:n_val]], test_tf)
        train_ds = Core50(tr_files[sel[n_val:]], tr_labels[sel[n_val:]], train_tf)
        sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
        loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, drop_last=True,
                            num_workers=args.workers, pin_memory=True)
        val_loader = DataLoader(val_ds, batch_size=128, sampler=DistributedSampler(val_ds, shuffle=False),
                                num_workers=args.workers)
        opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

        best_val, bad_epochs = -1.0, 0
        for ep in range(args.max_epochs):
            sampler.set_epoch(ep)
            tic = time.time()
            for x, y in loader:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                if memory.seen > 0:
                    mx, my = memory.sample(args.mem_batch)
                    logits = model(torch.cat([x, mx]))
                    loss = ace_loss(logits[:len(y)], y) + F.cross_entropy(logits[len(y):], my)
                else:
                    loss = ace_loss(model(x), y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                memory.add(x, y)
            val_acc = accuracy(net, val_loader, device)
            if rank == 0:
                print(f"task {t} ep {ep} loss {loss.item():.3f} val {val_acc:.4f} ({time.time() - tic:.0f}s)",
                      flush=True)
            if val_acc > best_val:
                best_val, bad_epochs = val_acc, 0
            else:
                bad_epochs += 1
                if bad_epochs >= args.patience:
                    break

        # test on everything seen so far, reduced over ranks
        seen = np.concatenate(tasks[:t + 1])
        te_idx = np.where(np.isin(te_labels, seen))[0][rank::world]
        te_loader = DataLoader(Core50(te_files[te_idx], te_labels[te_idx], test_tf), batch_size=256,
                               num_workers=args.workers)
        net.eval()
        stat = torch.zeros(2, device=device)
        with torch.no_grad():
            for x, y in te_loader:
                x, y = x.to(device), y.to(device)
                stat[0] += (net(x).argmax(1) == y).sum()
                stat[1] += y.numel()
        dist.all_reduce(stat)
        net.train()
        acc_hist.append((stat[0] / stat[1]).item())
        if rank == 0:
            print(f"== task {t}: test acc on {len(seen)} objects = {acc_hist[-1]:.4f}", flush=True)
            os.makedirs(args.out, exist_ok=True)
            torch.save({"model": net.state_dict(), "task": t, "acc": acc_hist},
                       os.path.join(args.out, "erace_last.pt"))
        dist.barrier()

    if rank == 0:
        print("final acc %.4f, mean over tasks %.4f" % (acc_hist[-1], float(np.mean(acc_hist))))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
