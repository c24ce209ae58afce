"""Joint+bone two-branch MS-GCN on NTU RGB+D 120 (X-Sub / X-Set).

Launch with torchrun, one process per GPU. --batch-size is the global batch.
"""
import argparse
import logging
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

logger = logging.getLogger("msg3d")

V = 25
EDGES = [(1, 2), (2, 21), (3, 21), (4, 3), (5, 21), (6, 5), (7, 6), (8, 7), (9, 21),
         (10, 9), (11, 10), (12, 11), (13, 1), (14, 13), (15, 14), (16, 15), (17, 1),
         (18, 17), (19, 18), (20, 19), (22, 23), (23, 8), (24, 25), (25, 12)]
BONE_PAIRS = [(i - 1, j - 1) for i, j in EDGES] + [(20, 20)]


def k_hop_adjacency(num_scales):
    a = np.zeros((V, V), dtype=np.float32)
    for i, j in EDGES:
        a[i - 1, j - 1] = a[j - 1, i - 1] = 1.0
    eye = np.eye(V, dtype=np.float32)
    mats, reach_prev = [], eye.copy()
    for k in range(num_scales):
        reach = np.minimum(np.linalg.matrix_power(a + eye, k), 1.0)
        hop = reach - (reach_prev if k > 0 else 0) + (eye if k > 0 else 0)
        hop = np.clip(hop, 0, 1)
        deg = hop.sum(1, keepdims=True)
        mats.append(hop / deg)
        reach_prev = reach
    return np.stack(mats)


class SkeletonNpy(Dataset):
    """data: (N, C, T, V, M) float32 memmap, label: (N,) int64."""

    def __init__(self, data_path, label_path, frames=64, train=True):
        self.data = np.load(data_path, mmap_mode="r")
        self.label = np.load(label_path).astype(np.int64)
        self.frames = frames
        self.train = train

    def __len__(self):
        return len(self.label)

    def __getitem__(self, i):
        x = np.array(self.data[i], dtype=np.float32)
        valid = np.nonzero(np.abs(x).sum(axis=(0, 2, 3)))[0]
        t = int(valid[-1]) + 1 if len(valid) else 1
        if self.train:
            idx = np.sort(np.random.choice(t, self.frames, replace=t < self.frames))
        else:
            idx = np.linspace(0, t - 1, self.frames).round().astype(np.int64)
        x = x[:, idx]
        bone = np.zeros_like(x)
        for v1, v2 in BONE_PAIRS:
            bone[:, :, v1] = x[:, :, v1] - x[:, :, v2]
        return torch.from_numpy(x), torch.from_numpy(bone), self.label[i], i


class MSGCN(nn.Module):
    def __init__(self, cin, cout, A):
        super().__init__()
        self.register_buffer("A", torch.from_numpy(A))
        self.A_res = nn.Parameter(torch.zeros_like(self.A).uniform_(-1e-6, 1e-6))
        self.mlp = nn.Sequential(nn.Conv2d(cin * A.shape[0], cout, 1), nn.BatchNorm2d(cout), nn.ReLU(inplace=True))

    def forward(self, x):
        n, c, t, v = x.shape
        a = self.A + self.A_res
        y = torch.einsum("kvu,nctu->nkctv", a, x).reshape(n, -1, t, v)
        return self.mlp(y)


class MSTCN(nn.Module):
    def __init__(self, channels, stride=1, dilations=(1, 2)):
        super().__init__()
        bc = channels // (len(dilations) + 1)
        self.branches = nn.ModuleList()
        for d in dilations:
            self.branches.append(nn.Sequential(
                nn.Conv2d(channels, bc, 1), nn.BatchNorm2d(bc), nn.ReLU(inplace=True),
                nn.Conv2d(bc, bc, (5, 1), (stride, 1), (2 * d, 0), (d, 1)), nn.BatchNorm2d(bc)))
        rest = channels - bc * len(dilations)
        self.branches.append(nn.Sequential(
            nn.Conv2d(channels, rest, 1), nn.BatchNorm2d(rest), nn.ReLU(inplace=True),
            nn.MaxPool2d((3, 1), (stride, 1), (1, 0)), nn.BatchNorm2d(rest)))

    def forward(self, x):
        return torch.cat([b(x) for b in self.branches], dim=1)


class Branch(nn.Module):
    def __init__(self, A, in_channels=3, num_person=2):
        super().__init__()
        self.data_bn = nn.BatchNorm1d(num_person * in_channels * V)
        cfg = [(in_channels, 96, 1), (96, 96, 1), (96, 192, 2), (192, 192, 1), (192, 384, 2), (384, 384, 1)]
        self.gcn = nn.ModuleList([MSGCN(ci, co, A) for ci, co, _ in cfg])
        self.tcn = nn.ModuleList([MSTCN(co, s) for _, co, s in cfg])
        self.res = nn.ModuleList([
            nn.Identity() if ci == co and s == 1 else nn.Sequential(nn.Conv2d(ci, co, 1, (s, 1)), nn.BatchNorm2d(co))
            for ci, co, s in cfg])

    def forward(self, x):
        n, c, t, v, m = x.shape
        x = self.data_bn(x.permute(0, 4, 3, 1, 2).reshape(n, m * v * c, t))
        x = x.reshape(n, m, v, c, t).permute(0, 1, 3, 4, 2).reshape(n * m, c, t, v)
        for g, tc, r in zip(self.gcn, self.tcn, self.res):
            x = F.relu(tc(g(x)) + r(x))
        return x.reshape(n, m, x.shape[1], -1).mean(-1).mean(1)


class TwoStreamNet(nn.Module):
    def __init__(self, num_class, num_scales=8, stream_drop=0.2):
        super().__init__()
        A = k_hop_adjacency(num_scales)
        self.joint = Branch(A)
        self.bone = Branch(A)
        self.fc_joint = nn.Linear(384, num_class)
        self.fc_bone = nn.Linear(384, num_class)
        self.stream_drop = stream_drop

    def forward(self, joint, bone, drop=None):
        # drop is drawn from a generator seeded identically on every rank, so all
        # ranks skip the same branch (SyncBatchNorm needs every rank in the same layer)
        use_j = use_b = True
        if self.training and drop is not None:
            r = float(drop)
            if r < self.stream_drop / 2:
                use_j = False
            elif r < self.stream_drop:
                use_b = False
        out = 0
        if use_j:
            out = out + self.fc_joint(self.joint(joint))
        if use_b:
            out = out + self.fc_bone(self.bone(bone))
        return out


@torch.no_grad()
def evaluate(model, loader, num_samples, num_class, device):
    """Gather every rank's scores, drop DistributedSampler's padded duplicates, score once."""
    model.eval()
    scores, indices, labels = [], [], []
    for joint, bone, y, idx in loader:
        logits = model(joint.to(device, non_blocking=True), bone.to(device, non_blocking=True))
        scores.append(logits.float())
        labels.append(y.to(device))
        indices.append(idx.to(device))
    scores, labels, indices = torch.cat(scores), torch.cat(labels), torch.cat(indices)
    world = dist.get_world_size()
    g_scores = [torch.empty_like(scores) for _ in range(world)]
    g_labels = [torch.empty_like(labels) for _ in range(world)]
    g_idx = [torch.empty_like(indices) for _ in range(world)]
    dist.all_gather(g_scores, scores)
    dist.all_gather(g_labels, labels)
    dist.all_gather(g_idx, indices)
    all_scores = torch.zeros(num_samples, num_class, device=device)
    all_labels = torch.zeros(num_samples, dtype=torch.long, device=device)
    for s, l, i in zip(g_scores, g_labels, g_idx):
        all_scores[i] = s
        all_labels[i] = l
    top5 = all_scores.topk(5, 1).indices
    top1 = (top5[:, 0] == all_labels).float().mean().item()
    top5 = (top5 == all_labels[:, None]).any(1).float().mean().item()
    return top1, top5, all_scores.cpu()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data-dir", default="data/ntu120/xsub")
    parser.add_argument("--out", default="runs/msg3d_ntu120_xsub_js")
    parser.add_argument("--num-class", type=int, default=120)
    parser.add_argument("--epochs", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--base-lr", type=float, default=0.05)
    parser.add_argument("--wd", type=float, default=5e-4)
    parser.add_argument("--frames", type=int, default=64)
    parser.add_argument("--stream-drop", type=float, default=0.2)
    parser.add_argument("--resume", default="")
    args = parser.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(message)s")
    assert args.batch_size % world == 0
    per_gpu = args.batch_size // world

    train_set = SkeletonNpy(f"{args.data_dir}/train_data.npy", f"{args.data_dir}/train_label.npy", args.frames)
    val_set = SkeletonNpy(f"{args.data_dir}/val_data.npy", f"{args.data_dir}/val_label.npy", args.frames, train=False)
    train_sampler = DistributedSampler(train_set, shuffle=True, seed=0, drop_last=True)
    val_sampler = DistributedSampler(val_set, shuffle=False)
    train_loader = DataLoader(train_set, per_gpu, sampler=train_sampler, num_workers=6,
                              pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, 128, sampler=val_sampler, num_workers=6, pin_memory=True)

    net = TwoStreamNet(args.num_class, stream_drop=args.stream_drop)
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net).to(device)
    # stream dropout leaves one branch out of the graph on some steps
    model = DistributedDataParallel(net, device_ids=[local_rank], find_unused_parameters=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.base_lr, momentum=0.9, nesterov=True, weight_decay=args.wd)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.base_lr, epochs=args.epochs,
                                                    steps_per_epoch=len(train_loader), pct_start=0.08)
    start_epoch, best = 0, 0.0
    if args.resume:
        ckpt = torch.load(args.resume, map_location=device)
        net.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optim"])
        scheduler.load_state_dict(ckpt["sched"])
        start_epoch, best = ckpt["epoch"], ckpt["best"]
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0, running = time.time(), torch.zeros(2, device=device)
        drop_gen = torch.Generator().manual_seed(1000 + epoch)
        for joint, bone, y, _ in train_loader:
            joint, bone, y = joint.to(device, non_blocking=True), bone.to(device, non_blocking=True), y.to(device)
            drop = torch.rand(1, generator=drop_gen).item()
            loss = F.cross_entropy(model(joint, bone, drop=drop), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            running += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(running)
        top1, top5, scores = evaluate(model, val_loader, len(val_set), args.num_class, device)
        if rank == 0:
            logger.info("epoch %d loss %.4f top1 %.2f top5 %.2f %.0fs", epoch + 1,
                        (running[0] / running[1]).item(), top1 * 100, top5 * 100, time.time() - t0)
            ckpt = {"model": net.state_dict(), "optim": optimizer.state_dict(), "sched": scheduler.state_dict(),
                    "epoch": epoch + 1, "best": max(best, top1)}
            torch.save(ckpt, os.path.join(args.out, "last.pt"))
            if top1 > best:
                torch.save(ckpt, os.path.join(args.out, "best.pt"))
                np.save(os.path.join(args.out, "best_scores.npy"), scores.numpy())
        best = max(best, top1)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
