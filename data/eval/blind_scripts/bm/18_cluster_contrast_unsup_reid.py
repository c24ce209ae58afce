"""Unsupervised person re-ID with Cluster Contrast (cluster-level memory + DBSCAN pseudo labels).

Every epoch: extract features of all training images on all GPUs, cluster on rank 0,
broadcast the pseudo labels, initialise the cluster memory from the centroids, train.

    torchrun --nproc_per_node=4 18_cluster_contrast_unsup_reid.py --root /data/market1501
"""
import argparse
import collections
import os
import os.path as osp
import re
import time
from glob import glob

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from PIL import Image
from sklearn.cluster import DBSCAN
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms as T


def args_parser():
    p = argparse.ArgumentParser()
    p.add_argument("--root", default="/data/market1501")
    p.add_argument("--batch-size", type=int, default=64, help="per GPU")
    p.add_argument("--epochs", type=int, default=50)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--lr", type=float, default=3.5e-4)
    p.add_argument("--eps", type=float, default=0.6)
    p.add_argument("--temp", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.2)
    p.add_argument("--logs", default="logs/cc_market")
    return p.parse_args()


def load_images(folder):
    out = []
    for path in sorted(glob(osp.join(folder, "*.jpg"))):
        pid, cam = map(int, re.search(r"([-\d]+)_c(\d)", path).groups())
        if pid != -1:
            out.append((path, pid, cam))
    return out


class ImageSet(Dataset):
    def __init__(self, items, tf):
        self.items, self.tf = items, tf

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        path, label, _ = self.items[i]
        return self.tf(Image.open(path).convert("RGB")), label, i


class ResNetReID(nn.Module):
    def __init__(self):
        super().__init__()
        r = torchvision.models.resnet50(weights="IMAGENET1K_V1")
        r.layer4[0].conv2.stride = (1, 1)
        r.layer4[0].downsample[0].stride = (1, 1)
        self.base = nn.Sequential(*list(r.children())[:-2])
        self.num_features = 2048
        self.feat_bn = nn.BatchNorm1d(self.num_features)
        self.feat_bn.bias.requires_grad_(False)

    def forward(self, x):
        x = F.adaptive_avg_pool2d(self.base(x), 1).flatten(1)
        return F.normalize(self.feat_bn(x))


class ClusterMemory(nn.Module):
    def __init__(self, num_features, num_clusters, temp=0.05, momentum=0.2):
        super().__init__()
        self.temp, self.momentum = temp, momentum
        self.register_buffer("features", torch.zeros(num_clusters, num_features))

    def forward(self, inputs, targets):
        logits = inputs @ self.features.t() / self.temp
        return F.cross_entropy(logits, targets)

    @torch.no_grad()
    def update(self, inputs, targets):
        for x, y in zip(inputs, targets):
            self.features[y] = self.momentum * self.features[y] + (1.0 - self.momentum) * x
            self.features[y] /= self.features[y].norm()


@torch.no_grad()
def extract_all(model, items, tf, device):
    ds = ImageSet(items, tf)
    loader = DataLoader(ds, 256, sampler=DistributedSampler(ds, shuffle=False), num_workers=8, pin_memory=True)
    model.eval()
    feats, idxs = [], []
    for x, _, i in loader:
        feats.append(model(x.to(device, non_blocking=True)))
        idxs.append(i.to(device))
    model.train()
    feats, idxs = torch.cat(feats), torch.cat(idxs)
    fb = [torch.empty_like(feats) for _ in range(dist.get_world_size())]
    ib = [torch.empty_like(idxs) for _ in range(dist.get_world_size())]
    dist.all_gather(fb, feats)
    dist.all_gather(ib, idxs)
    out = torch.empty(len(items), feats.size(1), device=device)
    out[torch.cat(ib)] = torch.cat(fb)
    return out


def concat_all_gather(t):
    bufs = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(bufs, t)
    return torch.cat(bufs)


def main():
    args = args_parser()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    norm = T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train_tf = T.Compose([T.Resize((256, 128)), T.RandomHorizontalFlip(), T.Pad(10), T.RandomCrop((256, 128)),
                          T.ToTensor(), norm, T.RandomErasing(p=0.5)])
    test_tf = T.Compose([T.Resize((256, 128)), T.ToTensor(), norm])
    train_items = load_images(osp.join(args.root, "bounding_box_train"))

    model = ResNetReID()
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(params, lr=args.lr, weight_decay=5e-4)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=20, gamma=0.1)
    if rank == 0:
        os.makedirs(args.logs, exist_ok=True)

    for epoch in range(args.epochs):
        feats = extract_all(model, train_items, test_tf, device)

        # cluster on rank 0 only and share the result so every rank trains with the same pseudo labels
        labels = [None]
        if rank == 0:
            f = feats.cpu().numpy()
            distmat = np.clip(2 - 2 * f @ f.T, 0, None)
            labels[0] = DBSCAN(eps=args.eps, min_samples=4, metric="precomputed", n_jobs=-1).fit_predict(distmat)
        dist.broadcast_object_list(labels, src=0)
        pseudo = labels[0]
        num_cluster = int(pseudo.max()) + 1

        centers = torch.zeros(num_cluster, feats.size(1), device=device)
        counts = collections.Counter(pseudo[pseudo >= 0].tolist())
        for i, lab in enumerate(pseudo):
            if lab >= 0:
                centers[lab] += feats[i]
        centers /= torch.tensor([counts[c] for c in range(num_cluster)], device=device).unsqueeze(1)
        memory = ClusterMemory(model.num_features, num_cluster, temp=args.temp,
                               momentum=args.momentum).to(device)
        memory.features = F.normalize(centers, dim=1)

        pseudo_items = [(path, int(lab), cam) for (path, _, cam), lab in zip(train_items, pseudo) if lab >= 0]
        if rank == 0:
            print(f"epoch {epoch}: {num_cluster} clusters, {len(pseudo_items)} clustered images", flush=True)
        train_set = ImageSet(pseudo_items, train_tf)
        sampler = DistributedSampler(train_set, shuffle=True, seed=epoch, drop_last=True)
        loader = DataLoader(train_set, args.batch_size, sampler=sampler, num_workers=8, pin_memory=True,
                            drop_last=True, persistent_workers=False)

        model.train()
        t0 = time.time()
        it = 0
        while it < args.iters:
            sampler.set_epoch(it)
            for x, y, _ in loader:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                f = model(x)
                loss = memory(f, y)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                memory.update(concat_all_gather(f.detach()), concat_all_gather(y))
                it += 1
                if rank == 0 and it % 50 == 0:
                    print(f"  it {it}/{args.iters} loss {loss.item():.4f} {time.time() - t0:.0f}s", flush=True)
                if it >= args.iters:
                    break
        scheduler.step()

        if rank == 0:
            torch.save({"model": model.module.state_dict(), "epoch": epoch},
                       osp.join(args.logs, "checkpoint.pth.tar"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
