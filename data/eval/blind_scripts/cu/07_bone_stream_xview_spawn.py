"""Bone-stream AGCN on NTU-60 cross-view, single-node multi-GPU via torch.multiprocessing.spawn.

    python 07_bone_stream_xview_spawn.py --gpus 4 --data data/ntu/xview
"""
import argparse
import os
import time
from collections import OrderedDict

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

PAIRS = ((1, 2), (2, 21), (3, 21), (4, 3), (5, 21), (6, 5), (7, 6), (8, 7), (9, 21), (10, 9), (11, 10),
         (12, 11), (13, 1), (14, 13), (15, 14), (16, 15), (17, 1), (18, 17), (19, 18), (20, 19),
         (22, 23), (23, 8), (24, 25), (25, 12))


def three_partition_graph(v=25):
    I = np.eye(v, dtype=np.float32)
    inward = np.zeros((v, v), dtype=np.float32)
    for a, b in PAIRS:
        inward[b - 1, a - 1] = 1
    outward = inward.T

    def col_norm(m):
        s = m.sum(0)
        s[s == 0] = 1
        return m / s

    return np.stack([I, col_norm(inward), col_norm(outward)])


class BoneFeeder(Dataset):
    def __init__(self, data_file, label_file, window=64, augment=False):
        self.data = np.load(data_file, mmap_mode="r")
        self.label = np.load(label_file)
        self.window = window
        self.augment = augment

    def __len__(self):
        return len(self.label)

    def __getitem__(self, i):
        x = np.asarray(self.data[i], dtype=np.float32)          # C, T, V, M
        valid = int(((x != 0).sum(axis=(0, 2, 3)) > 0).sum()) or 1
        x = x[:, :valid]
        bone = np.zeros_like(x)
        for a, b in PAIRS:
            bone[:, :, a - 1] = x[:, :, a - 1] - x[:, :, b - 1]
        if self.augment:
            ratio = np.random.uniform(0.6, 1.0)
            length = max(int(valid * ratio), 4)
            s = np.random.randint(0, valid - length + 1)
            bone = bone[:, s:s + length]
        t_idx = np.linspace(0, bone.shape[1] - 1, self.window).round().astype(np.int64)
        return torch.from_numpy(np.ascontiguousarray(bone[:, t_idx])), int(self.label[i]), i


class AGCNLayer(nn.Module):
    def __init__(self, cin, cout, A, stride=1, coff_embedding=4):
        super().__init__()
        inter = max(cout // coff_embedding, 4)
        self.register_buffer("A", torch.from_numpy(A))
        self.B = nn.Parameter(torch.full_like(self.A, 1e-6))
        self.theta = nn.ModuleList([nn.Conv2d(cin, inter, 1) for _ in range(A.shape[0])])
        self.phi = nn.ModuleList([nn.Conv2d(cin, inter, 1) for _ in range(A.shape[0])])
        self.g = nn.ModuleList([nn.Conv2d(cin, cout, 1) for _ in range(A.shape[0])])
        self.bn = nn.BatchNorm2d(cout)
        self.down = nn.Identity() if cin == cout else nn.Sequential(nn.Conv2d(cin, cout, 1), nn.BatchNorm2d(cout))
        self.tcn = nn.Sequential(nn.Conv2d(cout, cout, (9, 1), (stride, 1), (4, 0)), nn.BatchNorm2d(cout))
        self.res = (nn.Identity() if cin == cout and stride == 1
                    else nn.Sequential(nn.Conv2d(cin, cout, 1, (stride, 1)), nn.BatchNorm2d(cout)))

    def forward(self, x):
        n, c, t, v = x.shape
        y = 0
        for k in range(self.A.shape[0]):
            q = self.theta[k](x).permute(0, 3, 1, 2).reshape(n, v, -1)
            kk = self.phi[k](x).reshape(n, -1, v)
            C = torch.softmax(q @ kk / q.shape[-1], dim=-2)
            adj = self.A[k] + self.B[k] + C
            y = y + self.g[k](torch.einsum("nctv,nvw->nctw", x, adj))
        y = F.relu(self.bn(y) + self.down(x))
        return F.relu(self.tcn(y) + self.res(x))


class AGCN(nn.Module):
    def __init__(self, num_class=60, num_person=2, in_channels=3):
        super().__init__()
        A = three_partition_graph()
        self.data_bn = nn.BatchNorm1d(num_person * in_channels * 25)
        spec = [(in_channels, 64, 1), (64, 64, 1), (64, 64, 1), (64, 64, 1), (64, 128, 2),
                (128, 128, 1), (128, 128, 1), (128, 256, 2), (256, 256, 1), (256, 256, 1)]
        self.layers = nn.Sequential(*[AGCNLayer(a, b, A, s) for a, b, s in spec])
        self.fc = nn.Linear(256, num_class)

    def forward(self, x):
        n, c, t, v, m = x.shape
        x = self.data_bn(x.permute(0, 4, 3, 1, 2).reshape(n, m * v * c, t))
        x = x.reshape(n, m, v, c, t).permute(0, 1, 3, 4, 2).reshape(n * m, c, t, v)
        x = self.layers(x)
        return self.fc(x.reshape(n, m, x.shape[1], -1).mean(-1).mean(1))


def load_weights(net, path, device):
    state = torch.load(path, map_location=device)
    state = state.get("model", state)
    # older runs saved the DDP wrapper's state_dict
    state = OrderedDict((k[len("module."):] if k.startswith("module.") else k, v) for k, v in state.items())
    net.load_state_dict(state)


def worker(gpu, ngpus, args):
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(args.port))
    torch.cuda.set_device(gpu)
    dist.init_process_group("nccl", rank=gpu, world_size=ngpus)
    device = torch.device("cuda", gpu)
    torch.manual_seed(args.seed)
    np.random.seed(args.seed + gpu)

    train_set = BoneFeeder(f"{args.data}/train_data_joint.npy", f"{args.data}/train_label.npy", augment=True)
    val_set = BoneFeeder(f"{args.data}/val_data_joint.npy", f"{args.data}/val_label.npy")
    train_sampler = DistributedSampler(train_set, num_replicas=ngpus, rank=gpu, shuffle=True)
    val_sampler = DistributedSampler(val_set, num_replicas=ngpus, rank=gpu, shuffle=False)
    train_loader = DataLoader(train_set, batch_size=args.batch_size // ngpus, sampler=train_sampler,
                              num_workers=4, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=64, sampler=val_sampler, num_workers=4, pin_memory=True)

    net = AGCN(num_class=60).to(device)
    if args.init:
        load_weights(net, args.init, device)
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net)
    model = DDP(net, device_ids=[gpu])
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, nesterov=True, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[30, 40], gamma=0.1)

    if gpu == 0:
        os.makedirs(args.save_dir, exist_ok=True)
    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        for x, y, _ in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        scheduler.step()

        model.eval()
        preds = {}
        with torch.no_grad():
            for x, y, idx in val_loader:
                scores = model(x.to(device, non_blocking=True))
                for i, s in zip(idx.tolist(), scores.float().cpu()):
                    preds[i] = s
        gathered = [None] * ngpus
        dist.all_gather_object(gathered, preds)
        if gpu == 0:
            merged = {}
            for part in gathered:
                merged.update(part)
            keys = sorted(merged)
            score = torch.stack([merged[k] for k in keys])
            label = torch.as_tensor(val_set.label[keys]).long()
            top5 = score.topk(5, 1).indices
            top1_acc = (top5[:, 0] == label).float().mean().item()
            top5_acc = (top5 == label[:, None]).any(1).float().mean().item()
            print(f"epoch {epoch + 1} top1 {top1_acc:.4f} top5 {top5_acc:.4f} on {len(keys)} samples "
                  f"({time.time() - tic:.0f}s)", flush=True)
            torch.save({"model": net.state_dict(), "epoch": epoch + 1}, os.path.join(args.save_dir, "last.pt"))
            if top1_acc > best:
                best = top1_acc
                np.save(os.path.join(args.save_dir, "best_val_scores.npy"), score.numpy())
                torch.save({"model": net.state_dict(), "epoch": epoch + 1}, os.path.join(args.save_dir, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="data/ntu/xview")
    p.add_argument("--save-dir", default="runs/agcn_bone_xview")
    p.add_argument("--init", default="", help="warm-start weights")
    p.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    p.add_argument("--batch-size", type=int, default=64, help="global")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--epochs", type=int, default=50)
    p.add_argument("--port", type=int, default=29512)
    p.add_argument("--seed", type=int, default=1)
    return p.parse_args()


if __name__ == "__main__":
    args = parse_args()
    mp.spawn(worker, args=(args.gpus, args), nprocs=args.gpus, join=True)
