"""Strong-baseline person re-ID on Market-1501 (ResNet-50 + BNNeck, ID + triplet loss).

Launch with torchrun; each GPU gets P identities x K instances per step.
"""
import argparse
import glob
import os
import os.path as osp
import re
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler
from torch.utils.data.distributed import DistributedSampler
import torchvision.transforms as T


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data-root", default="/datasets/Market-1501-v15.09.15")
    p.add_argument("--num-instances", type=int, default=4)
    p.add_argument("--ids-per-gpu", type=int, default=16)
    p.add_argument("--epochs", type=int, default=120)
    p.add_argument("--base-lr", type=float, default=3.5e-4)
    p.add_argument("--margin", type=float, default=0.3)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out-dir", default="./logs/market_bnneck")
    return p.parse_args()


PATTERN = re.compile(r"([-\d]+)_c(\d)")


def read_split(folder, relabel):
    items, pids = [], set()
    for path in sorted(glob.glob(osp.join(folder, "*.jpg"))):
        pid, cam = map(int, PATTERN.search(path).groups())
        if pid == -1:
            continue
        items.append((path, pid, cam - 1))
        pids.add(pid)
    if relabel:
        mapping = {pid: i for i, pid in enumerate(sorted(pids))}
        items = [(p, mapping[pid], c) for p, pid, c in items]
    return items


class ReIDImages(Dataset):
    def __init__(self, items, transform):
        self.items = items
        self.transform = transform

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        path, pid, cam = self.items[i]
        img = Image.open(path).convert("RGB")
        return self.transform(img), pid, cam


class DistributedPKSampler(Sampler):
    """Builds the same global P x K list on every rank and hands each rank its own batches."""

    def __init__(self, items, ids_per_batch, num_instances, num_replicas, rank, seed=0):
        self.index_by_pid = {}
        for idx, (_, pid, _) in enumerate(items):
            self.index_by_pid.setdefault(pid, []).append(idx)
        self.pids = sorted(self.index_by_pid)
        self.P, self.K = ids_per_batch, num_instances
        self.num_replicas, self.rank, self.seed = num_replicas, rank, seed
        self.epoch = 0
        n_batches = len(self.pids) // self.P
        self.batches_per_rank = n_batches // num_replicas

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        rng = np.random.RandomState(self.seed + self.epoch)
        pids = rng.permutation(self.pids)
        batches = []
        for b in range(self.batches_per_rank * self.num_replicas):
            batch = []
            for pid in pids[b * self.P:(b + 1) * self.P]:
                idxs = self.index_by_pid[pid]
                batch.extend(rng.choice(idxs, self.K, replace=len(idxs) < self.K).tolist())
            batches.append(batch)
        for batch in batches[self.rank::self.num_replicas]:
            yield from batch

    def __len__(self):
        return self.batches_per_rank * self.P * self.K


class Baseline(nn.Module):
    def __init__(self, num_classes):
        super().__init__()
        resnet = torchvision.models.resnet50(weights="IMAGENET1K_V1")
        resnet.layer4[0].conv2.stride = (1, 1)
        resnet.layer4[0].downsample[0].stride = (1, 1)
        self.base = nn.Sequential(*list(resnet.children())[:-2])
        self.gap = nn.AdaptiveAvgPool2d(1)
        self.bottleneck = nn.BatchNorm1d(2048)
        self.bottleneck.bias.requires_grad_(False)
        self.classifier = nn.Linear(2048, num_classes, bias=False)
        nn.init.normal_(self.classifier.weight, std=0.001)

    def forward(self, x):
        global_feat = self.gap(self.base(x)).flatten(1)
        feat = self.bottleneck(global_feat)
        if self.training:
            return self.classifier(feat), global_feat
        return feat


def batch_hard_triplet(feats, pids, margin):
    d = torch.cdist(feats, feats)
    same = pids.unsqueeze(0) == pids.unsqueeze(1)
    hardest_pos = (d * same.float()).max(dim=1).values
    hardest_neg = (d + 1e5 * same.float()).min(dim=1).values
    return F.relu(hardest_pos - hardest_neg + margin).mean()


def compute_map_cmc(qf, gf, q_pids, g_pids, q_cams, g_cams, max_rank=10):
    distmat = torch.cdist(qf, gf).numpy()
    indices = np.argsort(distmat, axis=1)
    matches = g_pids[indices] == q_pids[:, None]
    all_cmc, all_ap = [], []
    for i in range(len(q_pids)):
        keep = ~((g_pids[indices[i]] == q_pids[i]) & (g_cams[indices[i]] == q_cams[i]))
        raw = matches[i][keep]
        if not raw.any():
            continue
        cmc = raw.cumsum()
        cmc[cmc > 1] = 1
        all_cmc.append(cmc[:max_rank])
        precision = raw.cumsum() / (np.arange(len(raw)) + 1.0)
        all_ap.append((precision * raw).sum() / raw.sum())
    return np.mean(all_ap), np.asarray(all_cmc).astype(np.float32).mean(axis=0)


@torch.no_grad()
def extract(model, loader, device):
    model.eval()
    feats, pids, cams = [], [], []
    for imgs, pid, cam in loader:
        imgs = imgs.to(device, non_blocking=True)
        f = model(imgs) + model(torch.flip(imgs, dims=[3]))
        feats.append(F.normalize(f).cpu())
        pids.append(pid)
        cams.append(cam)
    model.train()
    return torch.cat(feats), torch.cat(pids).numpy(), torch.cat(cams).numpy()


def main():
    args = parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)
    os.makedirs(args.out_dir, exist_ok=True)

    train_tf = T.Compose([T.Resize((256, 128)), T.RandomHorizontalFlip(), T.Pad(10),
                          T.RandomCrop((256, 128)), T.ToTensor(),
                          T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]),
                          T.RandomErasing(p=0.5, value=[0.485, 0.456, 0.406])])
    test_tf = T.Compose([T.Resize((256, 128)), T.ToTensor(),
                         T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])

    train_items = read_split(osp.join(args.data_root, "bounding_box_train"), relabel=True)
    query_items = read_split(osp.join(args.data_root, "query"), relabel=False)
    gallery_items = read_split(osp.join(args.data_root, "bounding_box_test"), relabel=False)
    num_classes = len({pid for _, pid, _ in train_items})

    sampler = DistributedPKSampler(train_items, args.ids_per_gpu, args.num_instances,
                                   world, rank, seed=args.seed)
    train_loader = DataLoader(ReIDImages(train_items, train_tf),
                              batch_size=args.ids_per_gpu * args.num_instances, sampler=sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    query_set = ReIDImages(query_items, test_tf)
    gallery_set = ReIDImages(gallery_items, test_tf)
    query_loader = DataLoader(query_set, batch_size=256, num_workers=args.workers,
                              sampler=DistributedSampler(query_set, shuffle=False))
    gallery_loader = DataLoader(gallery_set, batch_size=256, num_workers=args.workers,
                                sampler=DistributedSampler(gallery_set, shuffle=False))

    model = Baseline(num_classes)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])

    optimizer = torch.optim.Adam(model.parameters(), lr=args.base_lr, weight_decay=5e-4)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[40, 70], gamma=0.1)
    id_criterion = nn.CrossEntropyLoss(label_smoothing=0.1)

    best_map = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        start = time.time()
        for it, (imgs, pids, _) in enumerate(train_loader):
            imgs, pids = imgs.to(device, non_blocking=True), pids.to(device, non_blocking=True)
            # linear warmup over the first 10 epochs
            if epoch < 10:
                frac = (epoch * len(train_loader) + it) / (10 * len(train_loader))
                for g in optimizer.param_groups:
                    g["lr"] = args.base_lr * (0.1 + 0.9 * frac)
            scores, feats = model(imgs)
            loss = id_criterion(scores, pids) + batch_hard_triplet(feats, pids, args.margin)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if rank == 0 and it % 50 == 0:
                acc = (scores.argmax(1) == pids).float().mean().item()
                print(f"epoch {epoch} iter {it}/{len(train_loader)} loss {loss.item():.3f} "
                      f"acc {acc:.3f} ({time.time() - start:.0f}s)", flush=True)
        if epoch >= 10:
            scheduler.step()

        if (epoch + 1) % args.eval_every == 0 or epoch + 1 == args.epochs:
            qf, q_pids, q_cams = extract(model, query_loader, device)
            gf, g_pids, g_cams = extract(model, gallery_loader, device)
            mAP, cmc = compute_map_cmc(qf, gf, q_pids, g_pids, q_cams, g_cams)
            if rank == 0:
                print(f"[eval] epoch {epoch}: mAP {mAP:.2%} rank-1 {cmc[0]:.2%} "
                      f"rank-5 {cmc[4]:.2%}", flush=True)
                torch.save({"state_dict": model.module.state_dict(), "epoch": epoch, "mAP": mAP},
                           osp.join(args.out_dir, "last.pth"))
                if mAP > best_map:
                    best_map = mAP
                    torch.save(model.module.state_dict(), osp.join(args.out_dir, "best.pth"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
