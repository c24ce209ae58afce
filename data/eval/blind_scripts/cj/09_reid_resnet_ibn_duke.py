"""ResNet50-IBN-a + BNNeck re-ID on DukeMTMC-reID with a lower learning rate on the backbone.

torchrun --nproc_per_node=2 09_reid_resnet_ibn_duke.py --data-dir /data/DukeMTMC-reID --log-dir logs/duke_ibn
"""
import argparse
import glob
import os
import re
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision.transforms as T
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from ibnnet import resnet50_ibn_a  # pip install git+https://github.com/XingangPan/IBN-Net.git


def get_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data-dir", default="/data/DukeMTMC-reID")
    parser.add_argument("--log-dir", default="logs/duke_ibn")
    parser.add_argument("--batch-size", type=int, default=32, help="per GPU")
    parser.add_argument("--num-instances", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3.5e-4, help="head lr for a global batch of 64")
    parser.add_argument("--backbone-lr-mult", type=float, default=0.1)
    parser.add_argument("--epochs", type=int, default=60)
    parser.add_argument("--workers", type=int, default=8)
    return parser.parse_args()


def scan(folder):
    pat = re.compile(r"([-\d]+)_c(\d+)")
    out = []
    for f in sorted(glob.glob(os.path.join(folder, "*.jpg"))):
        pid, cam = map(int, pat.search(f).groups())
        out.append((f, pid, cam))
    return out


class DukeSet(Dataset):
    def __init__(self, samples, transform):
        self.samples, self.transform = samples, transform

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, idx):
        f, pid, cam = self.samples[idx]
        return self.transform(Image.open(f).convert("RGB")), pid, cam


class PKDistributedSampler(DistributedSampler):
    """DistributedSampler whose per-rank shards are laid out as K consecutive images of one identity."""

    def __init__(self, samples, num_instances, **kw):
        super().__init__(samples, **kw)
        self.k = num_instances
        self.pid_index = {}
        for i, (_, pid, _) in enumerate(samples):
            self.pid_index.setdefault(pid, []).append(i)
        self.pids = sorted(self.pid_index)
        n_chunks = sum(max(len(v), self.k) // self.k for v in self.pid_index.values())
        self.num_samples = n_chunks // self.num_replicas * self.k

    def __iter__(self):
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        chunks = []
        for pid in self.pids:
            idx = self.pid_index[pid]
            perm = torch.randperm(len(idx), generator=g).tolist()
            if len(idx) < self.k:
                perm = (perm * self.k)[:self.k]
            for s in range(0, len(perm) - self.k + 1, self.k):
                chunks.append([idx[j] for j in perm[s:s + self.k]])
        chunks = [chunks[i] for i in torch.randperm(len(chunks), generator=g).tolist()]
        per_rank = len(chunks) // self.num_replicas
        mine = chunks[self.rank * per_rank:(self.rank + 1) * per_rank]
        return iter([i for c in mine for i in c])

    def __len__(self):
        return self.num_samples


class ReIDNet(nn.Module):
    def __init__(self, num_classes):
        super().__init__()
        net = resnet50_ibn_a(pretrained=True)
        net.layer4[0].conv2.stride = (1, 1)
        net.layer4[0].downsample[0].stride = (1, 1)
        self.base = nn.Sequential(net.conv1, net.bn1, net.relu, net.maxpool, net.layer1, net.layer2, net.layer3, net.layer4)
        self.bottleneck = nn.BatchNorm1d(2048)
        self.bottleneck.bias.requires_grad_(False)
        self.classifier = nn.Linear(2048, num_classes, bias=False)
        nn.init.normal_(self.classifier.weight, std=0.001)

    def forward(self, x):
        f = F.adaptive_avg_pool2d(self.base(x), 1).flatten(1)
        bn = self.bottleneck(f)
        if self.training:
            return self.classifier(bn), f
        return bn


def triplet_hard(feat, target, margin=0.3):
    d = torch.cdist(feat, feat)
    pos = target.unsqueeze(1) == target.unsqueeze(0)
    ap = (d - 1e5 * (~pos).float()).max(1)[0]
    an = (d + 1e5 * pos.float()).min(1)[0]
    return F.relu(ap - an + margin).mean()


@torch.no_grad()
def compute_map(model, query, gallery, transform, device):
    model.eval()

    def extract(samples):
        dl = DataLoader(DukeSet(samples, transform), batch_size=128, num_workers=4)
        return torch.cat([F.normalize(model(x.to(device)), dim=1).cpu() for x, _, _ in dl])

    qf, gf = extract(query), extract(gallery)
    qp, qc = np.array([s[1] for s in query]), np.array([s[2] for s in query])
    gp, gc = np.array([s[1] for s in gallery]), np.array([s[2] for s in gallery])
    ranking = torch.argsort(-(qf @ gf.t()), dim=1).numpy()
    aps, top1 = [], []
    for i in range(len(query)):
        order = ranking[i]
        junk = (gp[order] == qp[i]) & (gc[order] == qc[i])
        good = (gp[order] == qp[i])[~junk]
        if good.sum() == 0:
            continue
        top1.append(float(good[0]))
        ranks = np.flatnonzero(good) + 1
        aps.append(np.mean(np.arange(1, len(ranks) + 1) / ranks))
    return float(np.mean(top1)), float(np.mean(aps))


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train = scan(os.path.join(args.data_dir, "bounding_box_train"))
    label_of = {pid: i for i, pid in enumerate(sorted({p for _, p, _ in train}))}
    train = [(f, label_of[p], c) for f, p, c in train]
    query = scan(os.path.join(args.data_dir, "query"))
    gallery = scan(os.path.join(args.data_dir, "bounding_box_test"))

    mean, std = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
    train_tf = T.Compose([T.Resize((256, 128), interpolation=T.InterpolationMode.BICUBIC), T.RandomHorizontalFlip(),
                          T.Pad(10), T.RandomCrop((256, 128)), T.ToTensor(), T.Normalize(mean, std),
                          T.RandomErasing(p=0.5, value=mean)])
    test_tf = T.Compose([T.Resize((256, 128), interpolation=T.InterpolationMode.BICUBIC), T.ToTensor(),
                         T.Normalize(mean, std)])

    sampler = PKDistributedSampler(train, args.num_instances, num_replicas=world, rank=rank, seed=7)
    loader = DataLoader(DukeSet(train, train_tf), batch_size=args.batch_size, sampler=sampler,
                        num_workers=args.workers, pin_memory=True, drop_last=True)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(ReIDNet(len(label_of))).to(device)
    model = DDP(model, device_ids=[local_rank])

    lr = args.lr * args.batch_size * world / 64
    optimizer = torch.optim.Adam([
        {"params": model.base.parameters(), "lr": lr * args.backbone_lr_mult},
        {"params": [model.bottleneck.weight], "lr": lr},
        {"params": model.classifier.parameters(), "lr": lr},
    ], lr=lr, weight_decay=5e-4)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=[g["lr"] for g in optimizer.param_groups],
                                                    total_steps=args.epochs * len(loader), pct_start=0.1)

    if rank == 0:
        os.makedirs(args.log_dir, exist_ok=True)
        log = open(os.path.join(args.log_dir, "train.log"), "a")

    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0, stats = time.time(), torch.zeros(3, device=device)
        for img, pid, _ in loader:
            img, pid = img.to(device, non_blocking=True), pid.to(device, non_blocking=True)
            logits, feat = model(img)
            id_loss = F.cross_entropy(logits, pid, label_smoothing=0.1)
            tri_loss = triplet_hard(feat, pid)
            optimizer.zero_grad(set_to_none=True)
            (id_loss + tri_loss).backward()
            optimizer.step()
            scheduler.step()
            stats += torch.stack([id_loss.detach(), tri_loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(stats)
        if rank == 0:
            msg = (f"epoch {epoch + 1} id {stats[0] / stats[2]:.4f} tri {stats[1] / stats[2]:.4f} "
                   f"time {time.time() - t0:.0f}s")
            print(msg, flush=True)
            log.write(msg + "\n")
            if (epoch + 1) % 10 == 0:
                r1, mAP = compute_map(model.module, query, gallery, test_tf, device)
                msg = f"epoch {epoch + 1} rank-1 {r1:.4f} mAP {mAP:.4f}"
                print(msg, flush=True)
                log.write(msg + "\n")
                log.flush()
                torch.save(model.module.state_dict(), os.path.join(args.log_dir, f"model_{epoch + 1}.pth"))
                if mAP > best:
                    best = mAP
                    torch.save(model.module.state_dict(), os.path.join(args.log_dir, "model_best.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
