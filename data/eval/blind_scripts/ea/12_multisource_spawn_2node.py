"""
Multi-source re-ID pre-training (Market-1501 + DukeMTMC-reID + CUHK03-NP + MSMT17)
for the surveillance deployment model. One process per GPU via mp.spawn, can span nodes.

node 0:  python 12_multisource_spawn_2node.py --nodes 2 --node-rank 0 --dist-url tcp://10.1.0.11:23456 \
             --data /mnt/nfs/reid --output /mnt/nfs/exp/multisource_r50
node 1:  python 12_multisource_spawn_2node.py --nodes 2 --node-rank 1 --dist-url tcp://10.1.0.11:23456 \
             --data /mnt/nfs/reid --output /mnt/nfs/exp/multisource_r50
"""
import argparse
import os
import os.path as osp
import random
import re
import time
from collections import defaultdict
from glob import glob

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
import torchvision.transforms as T
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler
from torchvision.models import resnet50, ResNet50_Weights

SOURCES = {
    "market": ("Market-1501-v15.09.15", "*.jpg"),
    "duke": ("DukeMTMC-reID", "*.jpg"),
    "cuhk03": ("cuhk03-np/detected", "*.png"),
    "msmt": ("MSMT17_V2/mask_train_v2", None),
}


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--output", required=True, help="must be on storage shared by all nodes")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--node-rank", type=int, default=0)
    p.add_argument("--dist-url", default="tcp://127.0.0.1:23456")
    p.add_argument("--global-batch", type=int, default=256)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--epochs", type=int, default=60)
    p.add_argument("--lr", type=float, default=3.5e-4)
    p.add_argument("--workers", type=int, default=6)
    p.add_argument("--resume", action="store_true")
    return p.parse_args()


def load_sources(root):
    """All training images of all sources; identities are prefixed with the source name."""
    rx = re.compile(r"([-\d]+)_c(\d+)")
    items = []
    for name, (sub, pattern) in SOURCES.items():
        if name == "msmt":
            with open(osp.join(root, "MSMT17_V2", "list_train.txt")) as f:
                for line in f:
                    rel, pid = line.split()
                    items.append((osp.join(root, sub, rel), f"msmt_{int(pid)}"))
            continue
        for path in sorted(glob(osp.join(root, sub, "bounding_box_train", pattern))):
            pid, _ = map(int, rx.search(osp.basename(path)).groups())
            if pid != -1:
                items.append((path, f"{name}_{pid}"))
    lut = {k: i for i, k in enumerate(sorted({key for _, key in items}))}
    return [(p, lut[key]) for p, key in items], len(lut)


def market_test(root):
    rx = re.compile(r"([-\d]+)_c(\d)")

    def read(d):
        out = []
        for p in sorted(glob(osp.join(root, "Market-1501-v15.09.15", d, "*.jpg"))):
            pid, cam = map(int, rx.search(osp.basename(p)).groups())
            if pid != -1:
                out.append((p, pid, cam - 1))
        return out
    return read("query"), read("bounding_box_test")


class Images(Dataset):
    def __init__(self, items, tf):
        self.items, self.tf = items, tf

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.tf(Image.open(self.items[i][0]).convert("RGB")), self.items[i][1]


class ShardedPKSampler(Sampler):
    def __init__(self, labels, global_batch, k, rank, world, seed=0):
        assert global_batch % (world * k) == 0
        self.gb, self.k, self.rank, self.world, self.seed = global_batch, k, rank, world, seed
        self.lb = global_batch // world
        self.epoch = 0
        self.by_id = defaultdict(list)
        for i, y in enumerate(labels):
            self.by_id[y].append(i)
        self.ids = sorted(self.by_id)
        self.steps = sum(max(len(v), k) // k for v in self.by_id.values()) * k // global_batch

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __len__(self):
        return self.steps * self.lb

    def __iter__(self):
        rng = np.random.default_rng(self.seed + self.epoch)
        stacks = {}
        for y in self.ids:
            v = np.asarray(self.by_id[y])
            v = rng.choice(v, self.k, replace=True) if len(v) < self.k else rng.permutation(v)
            stacks[y] = [v[j:j + self.k].tolist() for j in range(0, len(v) // self.k * self.k, self.k)]
        alive = list(self.ids)
        for _ in range(self.steps):
            if len(alive) < self.gb // self.k:
                return
            picked = rng.choice(len(alive), self.gb // self.k, replace=False)
            batch = []
            for j in picked:
                batch += stacks[alive[j]].pop()
            alive = [y for y in alive if stacks[y]]
            yield from batch[self.rank * self.lb:(self.rank + 1) * self.lb]


class Net(nn.Module):
    def __init__(self, n):
        super().__init__()
        r = resnet50(weights=ResNet50_Weights.IMAGENET1K_V1)
        r.layer4[0].conv2.stride = (1, 1)
        r.layer4[0].downsample[0].stride = (1, 1)
        self.body = nn.Sequential(*list(r.children())[:-2])
        self.bnneck = nn.BatchNorm1d(2048)
        self.bnneck.bias.requires_grad_(False)
        self.fc = nn.Linear(2048, n, bias=False)
        nn.init.normal_(self.fc.weight, std=0.001)

    def forward(self, x):
        f = F.adaptive_avg_pool2d(self.body(x), 1).flatten(1)
        b = self.bnneck(f)
        return (self.fc(b), f) if self.training else b


def tri_loss(f, y, m=0.3):
    d = torch.cdist(f, f)
    same = y[:, None] == y[None]
    return F.relu(d.masked_fill(~same, 0).amax(1) - d.masked_fill(same, 1e6).amin(1) + m).mean()


@torch.no_grad()
def market_map(net, query, gallery, tf, device):
    net.eval()
    items = [(p, pid) for p, pid, _ in query + gallery]
    f = torch.cat([net(x.to(device)) for x, _ in DataLoader(Images(items, tf), batch_size=256, num_workers=8)])
    f = F.normalize(f, dim=1)
    sim = (f[:len(query)] @ f[len(query):].t()).cpu().numpy()
    gp, gc = np.array([g[1] for g in gallery]), np.array([g[2] for g in gallery])
    aps, r1 = [], []
    for i, (_, qp, qc) in enumerate(query):
        o = np.argsort(-sim[i])
        m = gp[o][(gp[o] != qp) | (gc[o] != qc)] == qp
        if m.any():
            h = np.flatnonzero(m)
            aps.append(np.mean(np.arange(1, len(h) + 1) / (h + 1)))
            r1.append(h[0] == 0)
    return float(np.mean(aps)), float(np.mean(r1))


def worker(gpu, ngpus_per_node, args):
    rank = args.node_rank * ngpus_per_node + gpu
    world = args.nodes * ngpus_per_node
    torch.cuda.set_device(gpu)
    dist.init_process_group("nccl", init_method=args.dist_url, world_size=world, rank=rank)
    device = torch.device("cuda", gpu)
    torch.manual_seed(0)

    items, n_ids = load_sources(args.data)
    query, gallery = market_test(args.data)
    norm = T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    tf = T.Compose([T.Resize((256, 128)), T.RandomHorizontalFlip(), T.Pad(10), T.RandomCrop((256, 128)),
                    T.ToTensor(), norm, T.RandomErasing(p=0.5)])
    test_tf = T.Compose([T.Resize((256, 128)), T.ToTensor(), norm])
    sampler = ShardedPKSampler([y for _, y in items], args.global_batch, args.k, rank, world)
    loader = DataLoader(Images(items, tf), batch_size=args.global_batch // world, sampler=sampler,
                        num_workers=args.workers, pin_memory=True, drop_last=True)

    net = nn.SyncBatchNorm.convert_sync_batchnorm(Net(n_ids)).to(device)
    model = DDP(net, device_ids=[gpu])
    opt = torch.optim.Adam([p for p in net.parameters() if p.requires_grad], lr=args.lr, weight_decay=5e-4)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, [25, 45], 0.1)
    ce = nn.CrossEntropyLoss(label_smoothing=0.1)
    ckpt_file = osp.join(args.output, "last.pth")

    start = 0
    if args.resume and osp.isfile(ckpt_file):
        state = torch.load(ckpt_file, map_location=device)
        net.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        start = state["epoch"]
    if rank == 0:
        os.makedirs(args.output, exist_ok=True)
        print(f"world {world}, {n_ids} identities, {len(items)} images, start epoch {start}", flush=True)

    for epoch in range(start, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        acc = torch.zeros(3, device=device)
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            logits, feat = model(x)
            l_id, l_tri = ce(logits, y), tri_loss(feat, y)
            opt.zero_grad(set_to_none=True)
            (l_id + l_tri).backward()
            opt.step()
            acc += torch.stack([l_id.detach(), l_tri.detach(), torch.ones_like(l_id)])
        sched.step()
        dist.all_reduce(acc)
        if rank == 0:
            print(f"epoch {epoch + 1}: id {acc[0] / acc[2]:.3f} tri {acc[1] / acc[2]:.3f} "
                  f"{time.time() - t0:.0f}s", flush=True)
            torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch + 1}, ckpt_file)
            if (epoch + 1) % 10 == 0:
                mAP, r1 = market_map(net, query, gallery, test_tf, device)
                print(f"  market (seen) mAP {100 * mAP:.1f} R1 {100 * r1:.1f}", flush=True)
        dist.barrier()

    dist.destroy_process_group()


def main():
    args = get_args()
    ngpus_per_node = torch.cuda.device_count()
    mp.spawn(worker, nprocs=ngpus_per_node, args=(ngpus_per_node, args))


if __name__ == "__main__":
    main()
