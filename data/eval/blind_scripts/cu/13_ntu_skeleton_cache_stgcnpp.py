"""ST-GCN++ style model trained straight from the raw NTU .skeleton text files.

The first run parses nturgb+d_skeletons/*.skeleton into a cache folder
(joints.npy, memory-mapped by every worker, plus meta.npz with frame counts,
labels and subjects); later runs reuse the cache.
"""
import argparse
import datetime
import glob
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

XSUB_TRAIN = {1, 2, 4, 5, 8, 9, 13, 14, 15, 16, 17, 18, 19, 25, 27, 28, 31, 34, 35, 38}
MAX_T, MAX_M = 300, 2
PAIRS = [(1, 2), (2, 21), (3, 21), (4, 3), (5, 21), (6, 5), (7, 6), (8, 7), (9, 21), (10, 9), (11, 10),
         (12, 11), (13, 1), (14, 13), (15, 14), (16, 15), (17, 1), (18, 17), (19, 18), (20, 19),
         (22, 23), (23, 8), (24, 25), (25, 12)]


def read_skeleton(path):
    with open(path) as f:
        lines = f.read().split("\n")
    ptr = 0
    n_frames = int(lines[ptr]); ptr += 1
    data = np.zeros((3, MAX_T, 25, MAX_M), dtype=np.float32)
    for t in range(n_frames):
        n_bodies = int(lines[ptr]); ptr += 1
        for m in range(n_bodies):
            ptr += 1                                  # body info line
            n_joints = int(lines[ptr]); ptr += 1
            for v in range(n_joints):
                vals = lines[ptr].split(); ptr += 1
                if m < MAX_M and t < MAX_T and v < 25:
                    data[:, t, v, m] = [float(vals[0]), float(vals[1]), float(vals[2])]
    return data, min(n_frames, MAX_T)


def build_cache(raw_dir, cache_dir, missing_list):
    missing = set()
    if missing_list and os.path.exists(missing_list):
        missing = {l.strip() for l in open(missing_list) if l.strip()}
    files = [p for p in sorted(glob.glob(os.path.join(raw_dir, "*.skeleton")))
             if os.path.basename(p)[:-len(".skeleton")] not in missing]
    tmp_dir = cache_dir + f".tmp{os.getpid()}"
    os.makedirs(tmp_dir, exist_ok=True)
    joints = np.lib.format.open_memmap(os.path.join(tmp_dir, "joints.npy"), mode="w+", dtype=np.float32,
                                       shape=(len(files), 3, MAX_T, 25, MAX_M))
    names, lens, labels, subjects = [], [], [], []
    for k, p in enumerate(files):
        name = os.path.basename(p)[:-len(".skeleton")]
        joints[k], t = read_skeleton(p)
        names.append(name)
        lens.append(t)
        labels.append(int(name[17:20]) - 1)
        subjects.append(int(name[9:12]))
    joints.flush()
    del joints
    np.savez(os.path.join(tmp_dir, "meta.npz"), length=np.array(lens), label=np.array(labels),
             subject=np.array(subjects), name=np.array(names))
    os.replace(tmp_dir, cache_dir)


class CachedNTU(Dataset):
    def __init__(self, cache_dir, train, clip_len=100):
        meta = np.load(os.path.join(cache_dir, "meta.npz"))
        self.x = np.load(os.path.join(cache_dir, "joints.npy"), mmap_mode="r")
        self.index = np.nonzero([(s in XSUB_TRAIN) == train for s in meta["subject"]])[0]
        self.length = meta["length"][self.index]
        self.label = meta["label"][self.index]
        self.train, self.clip_len = train, clip_len

    def __len__(self):
        return len(self.label)

    def __getitem__(self, i):
        t = max(int(self.length[i]), 1)
        if self.train:
            # uniform sampling with random offset inside each segment (PYSKL UniformSample)
            edges = np.linspace(0, t, self.clip_len + 1)
            idx = np.floor(edges[:-1] + np.random.rand(self.clip_len) * (edges[1:] - edges[:-1])).astype(np.int64)
        else:
            idx = np.linspace(0, t - 1, self.clip_len).round().astype(np.int64)
        x = np.asarray(self.x[self.index[i]])[:, np.clip(idx, 0, t - 1)]
        x = x - x[:, :1, 1:2, :1]
        return torch.from_numpy(np.ascontiguousarray(x)), int(self.label[i]), i


def spatial_A():
    I = np.eye(25, dtype=np.float32)
    inw = np.zeros((25, 25), dtype=np.float32)
    for a, b in PAIRS:
        inw[b - 1, a - 1] = 1
    outw = inw.T.copy()
    norm = lambda m: m / np.maximum(m.sum(0, keepdims=True), 1)
    return np.stack([I, norm(inw), norm(outw)])


class GCN(nn.Module):
    def __init__(self, cin, cout, A):
        super().__init__()
        self.A = nn.Parameter(torch.from_numpy(A).clone())       # "importance" adaptive init
        self.pre = nn.Conv2d(cin, cout * A.shape[0], 1)
        self.bn = nn.BatchNorm2d(cout)
        self.down = nn.Identity() if cin == cout else nn.Sequential(nn.Conv2d(cin, cout, 1), nn.BatchNorm2d(cout))

    def forward(self, x):
        n, _, t, v = x.shape
        y = self.pre(x).view(n, self.A.shape[0], -1, t, v)
        y = torch.einsum("nkctv,kvw->nctw", y, self.A)
        return F.relu(self.bn(y) + self.down(x))


class MSTCN(nn.Module):
    def __init__(self, c, stride=1):
        super().__init__()
        bc = c // 4
        self.branches = nn.ModuleList([
            nn.Sequential(nn.Conv2d(c, bc, 1), nn.BatchNorm2d(bc), nn.ReLU(True),
                          nn.Conv2d(bc, bc, (3, 1), (stride, 1), (d, 0), (d, 1))) for d in (1, 2, 3)])
        self.branches.append(nn.Sequential(nn.Conv2d(c, c - 3 * bc, 1, (stride, 1))))
        self.bn = nn.BatchNorm2d(c)

    def forward(self, x):
        return self.bn(torch.cat([b(x) for b in self.branches], 1))


class STGCNpp(nn.Module):
    def __init__(self, num_class=60):
        super().__init__()
        A = spatial_A()
        self.data_bn = nn.BatchNorm1d(3 * 25 * MAX_M)
        plan = [(3, 64, 1), (64, 64, 1), (64, 64, 1), (64, 64, 1), (64, 128, 2), (128, 128, 1),
                (128, 128, 1), (128, 256, 2), (256, 256, 1), (256, 256, 1)]
        self.gcn = nn.ModuleList([GCN(a, b, A) for a, b, _ in plan])
        self.tcn = nn.ModuleList([MSTCN(b, s) for _, b, s in plan])
        self.res = nn.ModuleList([nn.Identity() if a == b and s == 1 else
                                  nn.Sequential(nn.Conv2d(a, b, 1, (s, 1)), nn.BatchNorm2d(b)) for a, b, s in plan])
        self.head = nn.Linear(256, num_class)

    def forward(self, x):
        n, c, t, v, m = x.shape
        x = self.data_bn(x.permute(0, 4, 3, 1, 2).reshape(n, m * v * c, t))
        x = x.view(n, m, v, c, t).permute(0, 1, 3, 4, 2).reshape(n * m, c, t, v)
        for g, tc, r in zip(self.gcn, self.tcn, self.res):
            x = F.relu(tc(g(x)) + r(x))
        return self.head(x.view(n, m, x.shape[1], -1).mean(-1).mean(1))


@torch.no_grad()
def gather_scores(model, loader, n_total, device):
    """Shards are unpadded and of unequal size: pad to the longest shard before all_gather."""
    model.eval()
    scores, idxs = [], []
    for x, _, idx in loader:
        scores.append(model(x.to(device, non_blocking=True)).float())
        idxs.append(idx.to(device))
    scores, idxs = torch.cat(scores), torch.cat(idxs)
    world = dist.get_world_size()
    n_local = torch.tensor([scores.shape[0]], device=device)
    sizes = [torch.zeros_like(n_local) for _ in range(world)]
    dist.all_gather(sizes, n_local)
    max_n = int(max(s.item() for s in sizes))
    pad_s = torch.zeros(max_n, scores.shape[1], device=device)
    pad_i = torch.full((max_n,), -1, dtype=torch.long, device=device)
    pad_s[:scores.shape[0]], pad_i[:idxs.shape[0]] = scores, idxs
    all_s = [torch.empty_like(pad_s) for _ in range(world)]
    all_i = [torch.empty_like(pad_i) for _ in range(world)]
    dist.all_gather(all_s, pad_s)
    dist.all_gather(all_i, pad_i)
    out = torch.zeros(n_total, scores.shape[1], device=device)
    for s, i in zip(all_s, all_i):
        valid = i >= 0
        out[i[valid]] = s[valid]
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--raw-dir", default="/data/ntu/nturgb+d_skeletons")
    ap.add_argument("--missing", default="/data/ntu/NTU_RGBD_samples_with_missing_skeletons.txt")
    ap.add_argument("--cache", default="/data/ntu/cache/ntu60_raw")
    ap.add_argument("--out", default="work_dirs/stgcnpp_ntu60_xsub_j")
    ap.add_argument("--epochs", type=int, default=80)
    ap.add_argument("--videos-per-gpu", type=int, default=16)
    ap.add_argument("--lr", type=float, default=0.1, help="for 8 GPUs x 16")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    # parsing ~57k .skeleton files on a cold cache keeps the other ranks in the barrier for a while
    dist.init_process_group("nccl", timeout=datetime.timedelta(hours=2))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    if rank == 0 and not os.path.exists(args.cache):
        os.makedirs(os.path.dirname(args.cache.rstrip("/")), exist_ok=True)
        t0 = time.time()
        build_cache(args.raw_dir, args.cache, args.missing)
        print(f"built {args.cache} in {time.time() - t0:.0f}s", flush=True)
    dist.barrier()

    train_set = CachedNTU(args.cache, train=True)
    test_set = CachedNTU(args.cache, train=False)
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, args.videos_per_gpu, sampler=sampler, num_workers=4,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    test_shard = torch.utils.data.Subset(test_set, list(range(rank, len(test_set), world)))
    test_loader = DataLoader(test_shard, 64, num_workers=4, pin_memory=True)

    model = STGCNpp(60)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])
    lr = args.lr * world * args.videos_per_gpu / 128
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, nesterov=True, weight_decay=5e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(train_loader), eta_min=0)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        for x, y, _ in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
        scores = gather_scores(model.module, test_loader, len(test_set), device)
        if rank == 0:
            label = torch.as_tensor(test_set.label, device=device)
            top5 = scores.topk(5, 1).indices
            top1_acc = (top5[:, 0] == label).float().mean().item()
            top5_acc = (top5 == label[:, None]).any(1).float().mean().item()
            print(f"epoch {epoch + 1}: top1 {top1_acc:.4f} top5 {top5_acc:.4f} ({time.time() - tic:.0f}s)", flush=True)
            torch.save({"state_dict": model.module.state_dict(), "epoch": epoch + 1},
                       os.path.join(args.out, "latest.pth"))
            if top1_acc > best:
                best = top1_acc
                torch.save({"state_dict": model.module.state_dict(), "epoch": epoch + 1},
                           os.path.join(args.out, "best_top1.pth"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
