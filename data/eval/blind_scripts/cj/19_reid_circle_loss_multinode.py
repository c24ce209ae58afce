"""ResNet-101 + GeM + BNNeck with CosFace classification and pair-wise circle loss, Market-1501 + CUHK03 merged.

Two nodes, 8 GPUs each; output goes to the shared filesystem.

torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD_NODE:29400 \
    19_reid_circle_loss_multinode.py --datasets /fs/data/market1501 /fs/data/cuhk03-np/labeled --out /fs/exp/r101_circle
"""
import argparse
import glob
import os
import os.path as osp
import re
from collections import defaultdict

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import torchvision.transforms as T
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--datasets", nargs="+", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--num-ids-per-gpu", type=int, default=4)
    ap.add_argument("--num-instances", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3.5e-4, help="for a global batch of 256")
    ap.add_argument("--epochs", type=int, default=60)
    ap.add_argument("--seed", type=int, default=20)
    return ap.parse_args()


PAT = re.compile(r"([-\d]+)_c(\d+)")


def scan(folder):
    return [(f, *map(int, PAT.search(osp.basename(f)).groups())) for f in sorted(glob.glob(osp.join(folder, "*.*g")))
            if int(PAT.search(osp.basename(f)).group(1)) >= 0]


def build_train(roots):
    items, offset = [], 0
    for root in roots:
        part = scan(osp.join(root, "bounding_box_train"))
        lut = {p: offset + i for i, p in enumerate(sorted({p for _, p, _ in part}))}
        items += [(f, lut[p], c) for f, p, c in part]
        offset += len(lut)
    return items, offset


class Crops(Dataset):
    def __init__(self, items, tf):
        self.items, self.tf = items, tf

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        f, pid, cam = self.items[i]
        return self.tf(Image.open(f).convert("RGB")), pid, cam


class DistributedBalancedSampler(Sampler):
    """Each global step draws P ids per GPU; every rank shuffles with the same (seed, epoch)."""

    def __init__(self, items, ids_per_gpu, instances, rank, world, seed):
        self.P, self.K, self.rank, self.world, self.seed = ids_per_gpu, instances, rank, world, seed
        self.epoch = 0
        self.pid_index = defaultdict(list)
        for i, (_, pid, _) in enumerate(items):
            self.pid_index[pid].append(i)
        self.pids = np.array(sorted(self.pid_index))
        self.steps = len(self.pids) // (self.P * self.world)

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __len__(self):
        return self.steps * self.P * self.K

    def __iter__(self):
        rng = np.random.default_rng([self.seed, self.epoch])
        pids = rng.permutation(self.pids)
        out = []
        for s in range(self.steps):
            base = (s * self.world + self.rank) * self.P
            for pid in pids[base:base + self.P]:
                idx = self.pid_index[int(pid)]
                out.extend(rng.choice(idx, size=self.K, replace=len(idx) < self.K).tolist())
        return iter(out)


class GeM(nn.Module):
    def __init__(self, p=3.0):
        super().__init__()
        self.p = nn.Parameter(torch.tensor(p))

    def forward(self, x):
        return F.avg_pool2d(x.clamp(min=1e-6).pow(self.p), x.shape[-2:]).pow(1 / self.p).flatten(1)


class Net(nn.Module):
    def __init__(self, num_classes, s=64.0, m=0.35):
        super().__init__()
        r = torchvision.models.resnet101(weights="IMAGENET1K_V2")
        r.layer4[0].conv2.stride = (1, 1)
        r.layer4[0].downsample[0].stride = (1, 1)
        self.body = nn.Sequential(*list(r.children())[:-2])
        self.pool = GeM()
        self.bnneck = nn.BatchNorm1d(2048)
        self.bnneck.bias.requires_grad_(False)
        self.weight = nn.Parameter(torch.randn(num_classes, 2048) * 0.01)
        self.s, self.m = s, m

    def forward(self, x, labels=None):
        f = self.pool(self.body(x))
        bn = self.bnneck(f)
        if not self.training:
            return bn
        cos = F.linear(F.normalize(bn), F.normalize(self.weight))
        logits = self.s * (cos - self.m * F.one_hot(labels, cos.size(1)))
        return logits, f


def circle_loss(feat, labels, m=0.25, gamma=128):
    feat = F.normalize(feat, dim=1)
    sim = feat @ feat.t()
    same = labels[:, None] == labels[None]
    eye = torch.eye(len(labels), dtype=torch.bool, device=feat.device)
    sp, sn = sim[same & ~eye], sim[~same]
    ap = torch.clamp_min(-sp.detach() + 1 + m, 0.0)
    an = torch.clamp_min(sn.detach() + m, 0.0)
    logit_p = -ap * (sp - (1 - m)) * gamma
    logit_n = an * (sn - m) * gamma
    return F.softplus(torch.logsumexp(logit_n, 0) + torch.logsumexp(logit_p, 0))


@torch.no_grad()
def test_market(model, root, tf, device):
    model.eval()
    q, g = scan(osp.join(root, "query")), scan(osp.join(root, "bounding_box_test"))

    def embed(items):
        dl = DataLoader(Crops(items, tf), batch_size=256, num_workers=8)
        return torch.cat([F.normalize(model(x.to(device)), dim=1).cpu() for x, _, _ in dl])

    qf, gf = embed(q), embed(g)
    qp, qc = np.array([i[1] for i in q]), np.array([i[2] for i in q])
    gp, gc = np.array([i[1] for i in g]), np.array([i[2] for i in g])
    order = torch.argsort(qf @ gf.t(), dim=1, descending=True).numpy()
    r1, aps = [], []
    for i in range(len(q)):
        o = order[i]
        keep = ~((gp[o] == qp[i]) & (gc[o] == qc[i]))
        good = gp[o][keep] == qp[i]
        if good.any():
            r1.append(good[0])
            pos = np.flatnonzero(good)
            aps.append(np.mean(np.arange(1, len(pos) + 1) / (pos + 1)))
    return float(np.mean(r1)), float(np.mean(aps))


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    items, num_classes = build_train(args.datasets)
    norm = T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train_tf = T.Compose([T.Resize((384, 128)), T.RandomHorizontalFlip(), T.Pad(10), T.RandomCrop((384, 128)),
                          T.ColorJitter(0.15, 0.1, 0.1, 0.0), T.ToTensor(), norm, T.RandomErasing(p=0.5)])
    test_tf = T.Compose([T.Resize((384, 128)), T.ToTensor(), norm])

    sampler = DistributedBalancedSampler(items, args.num_ids_per_gpu, args.num_instances, rank, world, args.seed)
    loader = DataLoader(Crops(items, train_tf), batch_size=args.num_ids_per_gpu * args.num_instances,
                        sampler=sampler, num_workers=10, pin_memory=True, drop_last=True, persistent_workers=True)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(Net(num_classes)).to(device)
    model = DDP(model, device_ids=[local_rank])
    global_batch = args.num_ids_per_gpu * args.num_instances * world
    lr = args.lr * global_batch / 256
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=5e-4)
    iters = args.epochs * len(loader)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=iters, pct_start=0.05,
                                                    anneal_strategy="cos")
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"{num_classes} identities, {len(items)} images, global batch {global_batch}, lr {lr:.2e}", flush=True)

    for epoch in range(args.epochs):
        model.train()
        agg = torch.zeros(3, device=device)
        for img, pid, _ in loader:
            img, pid = img.to(device, non_blocking=True), pid.to(device, non_blocking=True)
            logits, feat = model(img, pid)
            ce = F.cross_entropy(logits, pid, label_smoothing=0.1)
            cl = circle_loss(feat, pid)
            optimizer.zero_grad(set_to_none=True)
            (ce + cl).backward()
            optimizer.step()
            scheduler.step()
            agg += torch.stack([ce.detach(), cl.detach(), torch.ones((), device=device)])
        dist.all_reduce(agg)
        if rank == 0:
            print(f"epoch {epoch + 1}: ce {agg[0] / agg[2]:.4f} circle {agg[1] / agg[2]:.4f}", flush=True)
            if (epoch + 1) % 10 == 0:
                r1, mAP = test_market(model.module, args.datasets[0], test_tf, device)
                print(f"  Market-1501 rank-1 {100 * r1:.2f} mAP {100 * mAP:.2f}", flush=True)
                torch.save({"model": model.module.state_dict(), "epoch": epoch + 1, "num_classes": num_classes},
                           osp.join(args.out, f"r101_circle_ep{epoch + 1}.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
