"""Hand-gesture recognition on SHREC'17 / DHG-14/28 with a DSTA-Net style
decoupled spatial-temporal attention network (22 hand joints).

    torchrun --nproc_per_node=4 16_shrec17_hand_gesture_dsta.py --num-class 28
"""
import argparse
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

N_JOINT = 22
# wrist 0, palm 1, thumb 2-5, index 6-9, middle 10-13, ring 14-17, pinky 18-21
HAND_BONES = [(0, 1), (0, 2), (2, 3), (3, 4), (4, 5), (1, 6), (6, 7), (7, 8), (8, 9), (1, 10), (10, 11),
              (11, 12), (12, 13), (1, 14), (14, 15), (15, 16), (16, 17), (1, 18), (18, 19), (19, 20), (20, 21)]


class SHRECSequences(Dataset):
    """Reads the list file: <gesture> <finger> <subject> <essai> <label_14> <label_28> <size>."""

    def __init__(self, root, list_file, num_class=14, frames=32, train=True):
        self.items = []
        with open(os.path.join(root, list_file)) as f:
            for line in f:
                g, fi, s, e, l14, l28, _ = line.split()
                path = os.path.join(root, f"gesture_{g}", f"finger_{fi}", f"subject_{s}", f"essai_{e}",
                                    "skeletons_world.txt")
                self.items.append((path, int(l14 if num_class == 14 else l28) - 1))
        self.frames, self.train = frames, train
        self.cache = {}

    def __len__(self):
        return len(self.items)

    def _load(self, path):
        if path not in self.cache:
            self.cache[path] = np.loadtxt(path, dtype=np.float32).reshape(-1, N_JOINT, 3)
        return self.cache[path]

    def __getitem__(self, i):
        path, label = self.items[i]
        seq = self._load(path)
        t = len(seq)
        if self.train:
            edges = np.linspace(0, t, self.frames + 1)
            idx = np.minimum((edges[:-1] + np.random.rand(self.frames) * np.diff(edges)).astype(np.int64), t - 1)
        else:
            idx = np.linspace(0, t - 1, self.frames).round().astype(np.int64)
        seq = seq[idx] - seq[0:1, 1:2]                                 # palm of first frame at origin
        if self.train:
            seq = seq * np.random.uniform(0.8, 1.2, (1, 1, 3)).astype(np.float32)
            seq = seq + np.random.normal(0, 0.002, seq.shape).astype(np.float32)
        return torch.from_numpy(seq.transpose(2, 0, 1).copy()), label                # C, T, V


class STAttention(nn.Module):
    """Spatial attention over joints (per frame) then temporal attention over frames (per joint)."""

    def __init__(self, cin, cout, heads=4, stride=1, frames=32):
        super().__init__()
        self.heads = heads
        self.pe_s = nn.Parameter(torch.zeros(1, cin, 1, N_JOINT))
        self.pe_t = nn.Parameter(torch.zeros(1, cout, frames, 1))
        self.qk_s = nn.Conv2d(cin, 2 * heads * 16, 1)
        self.v_s = nn.Conv2d(cin, cout, 1)
        self.out_s = nn.Sequential(nn.BatchNorm2d(cout), nn.LeakyReLU(0.1))
        self.qk_t = nn.Conv2d(cout, 2 * heads * 16, 1)
        self.v_t = nn.Conv2d(cout, cout, 1)
        self.out_t = nn.Sequential(nn.Conv2d(cout, cout, (stride, 1), (stride, 1)), nn.BatchNorm2d(cout), nn.LeakyReLU(0.1))
        self.res_s = nn.Identity() if cin == cout else nn.Sequential(nn.Conv2d(cin, cout, 1), nn.BatchNorm2d(cout))
        self.res_t = (nn.Identity() if stride == 1 else
                      nn.Sequential(nn.Conv2d(cout, cout, 1, (stride, 1)), nn.BatchNorm2d(cout)))

    def _attend(self, qk, v, dim):
        n, _, t, w = qk.shape
        q, k = qk.view(n, 2, self.heads, -1, t, w).unbind(1)
        if dim == "s":
            att = torch.einsum("nhctu,nhctv->nhuv", q, k) / math.sqrt(q.shape[2] * t)
            att = att.softmax(-1)
            v = v.view(n, self.heads, -1, t, w)
            return torch.einsum("nhuv,nhctv->nhctu", att, v).reshape(n, -1, t, w)
        att = torch.einsum("nhctv,nhcsv->nhts", q, k) / math.sqrt(q.shape[2] * w)
        att = att.softmax(-1)
        v = v.view(n, self.heads, -1, t, w)
        return torch.einsum("nhts,nhcsv->nhctv", att, v).reshape(n, -1, t, w)

    def forward(self, x):
        xs = x + self.pe_s
        y = self.out_s(self._attend(self.qk_s(xs), self.v_s(x), "s")) + self.res_s(x)
        yt = y + self.pe_t[:, :, :y.shape[2]]
        z = self.out_t(self._attend(self.qk_t(yt), self.v_t(y), "t")) + self.res_t(y)
        return z


class DSTANet(nn.Module):
    def __init__(self, num_class=14, frames=32):
        super().__init__()
        self.embed = nn.Sequential(nn.Conv2d(3, 64, 1), nn.BatchNorm2d(64), nn.LeakyReLU(0.1))
        cfg = [(64, 64, 1), (64, 64, 1), (64, 128, 2), (128, 128, 1), (128, 256, 2), (256, 256, 1)]
        layers, t = [], frames
        for cin, cout, s in cfg:
            layers.append(STAttention(cin, cout, stride=s, frames=t))
            t = t // s
        self.layers = nn.Sequential(*layers)
        self.drop = nn.Dropout(0.3)
        self.fc = nn.Linear(256, num_class)

    def forward(self, x):
        x = self.layers(self.embed(x))
        return self.fc(self.drop(x.mean((2, 3))))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="/data/HandGestureDataset_SHREC2017")
    ap.add_argument("--num-class", type=int, default=14, choices=[14, 28])
    ap.add_argument("--frames", type=int, default=32)
    ap.add_argument("--epochs", type=int, default=150)
    ap.add_argument("--batch-size", type=int, default=32, help="per GPU")
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--out", default="runs/dsta_shrec")
    ap.add_argument("--local_rank", type=int, default=0)
    args = ap.parse_args()

    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", args.local_rank)
    torch.manual_seed(0)
    np.random.seed(rank)

    train_set = SHRECSequences(args.root, "train_gestures.txt", args.num_class, args.frames, True)
    test_set = SHRECSequences(args.root, "test_gestures.txt", args.num_class, args.frames, False)
    sampler = DistributedSampler(train_set, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=4,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    test_loader = DataLoader(test_set, batch_size=64, num_workers=4)

    model = DSTANet(args.num_class, args.frames).to(device)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = DDP(model, device_ids=[args.local_rank], output_device=args.local_rank)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * args.batch_size * world / 128,
                                momentum=0.9, nesterov=True, weight_decay=5e-4)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[60, 90, 120], gamma=0.1)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        run = torch.zeros(2, device=device)
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y, label_smoothing=0.1)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            run += torch.stack([loss.detach(), torch.ones((), device=device)])
        scheduler.step()
        dist.all_reduce(run)

        if rank == 0:
            net = model.module
            net.eval()
            correct = total = 0
            with torch.no_grad():
                for x, y in test_loader:
                    pred = net(x.to(device)).argmax(1).cpu()
                    correct += (pred == y).sum().item()
                    total += len(y)
            acc = correct / total
            print(f"epoch {epoch + 1} loss {(run[0] / run[1]).item():.4f} test acc {acc:.4f} "
                  f"({time.time() - tic:.0f}s)", flush=True)
            torch.save(net.state_dict(), os.path.join(args.out, f"dsta_{args.num_class}_last.pt"))
            if acc > best:
                best = acc
                torch.save(net.state_dict(), os.path.join(args.out, f"dsta_{args.num_class}_best.pt"))
        dist.barrier()

    if rank == 0:
        print(f"best test acc {best:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
