"""Hierarchical local SGD for keyword spotting on precomputed log-mel features.

Replicas train independently; every --intra-every steps they are averaged
inside the node (fast NVLink), every --inter-every steps across all nodes.
Two-level scheme after Lin et al., "Don't Use Large Mini-Batches, Use Local SGD".

    torchrun --nnodes=2 --nproc_per_node=4 --rdzv_backend=c10d \
        --rdzv_endpoint=$MASTER_NODE:29400 07_hier_avg_kws.py \
        --features /mnt/shared/kws/feats --out /mnt/shared/kws/runs/hier
"""
import argparse
import json
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

LABELS = ["yes", "no", "up", "down", "left", "right", "on", "off", "stop", "go", "_unknown_", "_silence_"]


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--features", required=True, help="dir with {train,valid}_x.npy / _y.npy")
    ap.add_argument("--out", required=True, help="run dir on the shared file system")
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--batch-size", type=int, default=96)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--intra-every", type=int, default=4)
    ap.add_argument("--inter-every", type=int, default=32)
    ap.add_argument("--seed", type=int, default=3)
    return ap.parse_args()


class Feats(Dataset):
    def __init__(self, root, split, specaug=False):
        self.x = np.load(os.path.join(root, f"{split}_x.npy"), mmap_mode="r")  # N x 40 x 101
        self.y = np.load(os.path.join(root, f"{split}_y.npy"))
        self.specaug = specaug

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        x = torch.from_numpy(np.array(self.x[i], dtype=np.float32))
        if self.specaug:
            f0 = np.random.randint(0, 40 - 8)
            x[f0:f0 + np.random.randint(0, 8)] = 0
            t0 = np.random.randint(0, 101 - 20)
            x[:, t0:t0 + np.random.randint(0, 20)] = 0
        return x, int(self.y[i])


class DSCNN(nn.Module):
    def __init__(self, n_classes, ch=172):
        super().__init__()
        layers = [nn.Conv2d(1, ch, (10, 4), stride=(2, 2), padding=(5, 1)), nn.BatchNorm2d(ch), nn.ReLU()]
        for _ in range(4):
            layers += [nn.Conv2d(ch, ch, 3, padding=1, groups=ch), nn.BatchNorm2d(ch), nn.ReLU(),
                       nn.Conv2d(ch, ch, 1), nn.BatchNorm2d(ch), nn.ReLU()]
        self.body = nn.Sequential(*layers)
        self.fc = nn.Linear(ch, n_classes)

    def forward(self, x):
        x = self.body(x.unsqueeze(1))
        return self.fc(x.mean(dim=(2, 3)))


def build_node_groups():
    """One process group per node. new_group is collective over the default
    group, so every rank creates every node's group, in the same order."""
    world = dist.get_world_size()
    rank = dist.get_rank()
    per_node = int(os.environ["LOCAL_WORLD_SIZE"])
    mine = None
    for node in range(world // per_node):
        ranks = list(range(node * per_node, (node + 1) * per_node))
        g = dist.new_group(ranks=ranks)
        if rank in ranks:
            mine = g
    return mine, per_node


@torch.no_grad()
def average(model, group, size):
    tensors = [p.data for p in model.parameters()]
    tensors += [b for b in model.buffers() if b.dtype.is_floating_point]
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, group=group)
    flat.div_(size)
    off = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[off:off + n].view_as(t))
        off += n


@torch.no_grad()
def evaluate(model, loader, device, n_classes):
    model.eval()
    conf = torch.zeros(n_classes, n_classes, device=device, dtype=torch.long)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        pred = model(x).argmax(1)
        conf.index_put_((y, pred), torch.ones_like(y), accumulate=True)
    dist.all_reduce(conf)
    acc = conf.diag().sum().item() / max(conf.sum().item(), 1)
    return acc, conf.cpu()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    node_group, per_node = build_node_groups()
    torch.manual_seed(args.seed)
    np.random.seed(args.seed + rank)  # specaug differs per replica

    train_ds = Feats(args.features, "train", specaug=True)
    valid_ds = Feats(args.features, "valid")
    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=4,
                          pin_memory=True, drop_last=True, persistent_workers=True,
                          worker_init_fn=lambda w: np.random.seed(args.seed * 1000 + rank * 16 + w))
    valid_dl = DataLoader(torch.utils.data.Subset(valid_ds, range(rank, len(valid_ds), world)),
                          batch_size=512, num_workers=2)

    model = DSCNN(len(LABELS)).to(device)
    for t in model.state_dict().values():
        dist.broadcast(t, src=0)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, epochs=args.epochs,
                                                steps_per_epoch=len(train_dl))
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"world {world}, {per_node}/node, {len(train_dl)} steps/epoch", flush=True)

    step, history = 0, []
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        local_loss = torch.zeros(2, device=device)
        for x, y in train_dl:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y, label_smoothing=0.05)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            step += 1
            if step % args.inter_every == 0:
                average(model, None, world)
            elif step % args.intra_every == 0:
                average(model, node_group, per_node)
            local_loss[0] += loss.detach()
            local_loss[1] += 1

        average(model, None, world)
        dist.all_reduce(local_loss)
        acc, conf = evaluate(model, valid_dl, device, len(LABELS))
        history.append({"epoch": epoch, "loss": (local_loss[0] / local_loss[1]).item(), "acc": acc})
        if rank == 0:
            print(f"epoch {epoch} loss {history[-1]['loss']:.4f} acc {acc:.4f} ({time.time() - t0:.0f}s)",
                  flush=True)
            torch.save({"model": model.state_dict(), "epoch": epoch, "labels": LABELS, "confusion": conf},
                       os.path.join(args.out, "model.pt"))
        dist.barrier()

    # collect per-replica throughput for the report
    rec = {"rank": rank, "host": os.uname().nodename, "steps": step}
    gathered = [None] * world if rank == 0 else None
    dist.gather_object(rec, gathered, dst=0)
    if rank == 0:
        with open(os.path.join(args.out, "history.json"), "w") as f:
            json.dump({"history": history, "replicas": gathered}, f, indent=2)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
