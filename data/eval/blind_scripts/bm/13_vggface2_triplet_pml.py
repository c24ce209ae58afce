"""Triplet fine-tuning of a face embedder on VGGFace2 with pytorch-metric-learning.

Mining and the loss run over the embeddings of all GPUs (DistributedLossWrapper /
DistributedMinerWrapper), so hard negatives can come from any rank's batch.

    torchrun --nproc_per_node=8 13_vggface2_triplet_pml.py --list /data/vggface2/train_list.txt
"""
import argparse
import io
import os
import pickle
import random
import time
from collections import defaultdict

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import timm
from PIL import Image
from pytorch_metric_learning import distances, losses, miners
from pytorch_metric_learning.utils import distributed as pml_dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler
from torchvision import transforms


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--root", default="/data/vggface2/train_aligned_112")
    p.add_argument("--list", default="/data/vggface2/train_list.txt")
    p.add_argument("--lfw", default="/data/eval/lfw.bin")
    p.add_argument("--arch", default="convnext_tiny.fb_in22k")
    p.add_argument("--embedding", type=int, default=512)
    p.add_argument("--ids-per-gpu", type=int, default=32)
    p.add_argument("--imgs-per-id", type=int, default=4)
    p.add_argument("--iters-per-epoch", type=int, default=2000)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--margin", type=float, default=0.2)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--out", default="ckpt/vgg2_triplet")
    return p.parse_args()


class VGGFace2List(Dataset):
    def __init__(self, root, list_file, transform):
        with open(list_file) as f:
            rel_paths = [line.strip() for line in f if line.strip()]
        identities = list(set(p.split("/")[0] for p in rel_paths))
        self.class_to_idx = {name: i for i, name in enumerate(identities)}
        self.samples = [(os.path.join(root, p), self.class_to_idx[p.split("/")[0]]) for p in rel_paths]
        self.targets = [t for _, t in self.samples]
        self.transform = transform

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        path, target = self.samples[i]
        return self.transform(Image.open(path).convert("RGB")), target


class DistributedPKSampler(Sampler):
    def __init__(self, targets, P, K, iters, rank, world, seed):
        self.by_class = defaultdict(list)
        for i, t in enumerate(targets):
            self.by_class[t].append(i)
        self.classes = sorted(self.by_class)
        self.P, self.K, self.iters = P, K, iters
        self.rank, self.world, self.seed, self.epoch = rank, world, seed, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __len__(self):
        return self.iters * self.P * self.K

    def __iter__(self):
        rng = random.Random(self.seed + 1000 * self.epoch + self.rank)
        for _ in range(self.iters):
            for c in rng.sample(self.classes, self.P):
                pool = self.by_class[c]
                yield from (rng.sample(pool, self.K) if len(pool) >= self.K else rng.choices(pool, k=self.K))


class Embedder(nn.Module):
    def __init__(self, arch, dim):
        super().__init__()
        self.trunk = timm.create_model(arch, pretrained=True, num_classes=0)
        self.neck = nn.Sequential(nn.Linear(self.trunk.num_features, dim), nn.BatchNorm1d(dim))

    def forward(self, x):
        return self.neck(self.trunk(x))


@torch.no_grad()
def lfw_eval(model, path, device):
    with open(path, "rb") as f:
        bins, issame = pickle.load(f, encoding="bytes")
    tf = transforms.Compose([transforms.ToTensor(), transforms.Normalize([0.5] * 3, [0.5] * 3)])
    imgs = torch.stack([tf(Image.open(io.BytesIO(b)).convert("RGB")) for b in bins])
    model.eval()
    embs = torch.cat([F.normalize(model(x.to(device)) + model(x.flip(3).to(device))) for x in imgs.split(256)])
    model.train()
    sims = (embs[0::2] * embs[1::2]).sum(1).cpu().numpy()
    issame = np.asarray(issame)
    return max(np.mean((sims > t) == issame) for t in np.linspace(-1, 1, 1001))


def main():
    args = parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    train_tf = transforms.Compose([transforms.RandomHorizontalFlip(), transforms.ColorJitter(0.2, 0.2, 0.2),
                                   transforms.ToTensor(), transforms.Normalize([0.5] * 3, [0.5] * 3)])
    dataset = VGGFace2List(args.root, args.list, train_tf)
    sampler = DistributedPKSampler(dataset.targets, args.ids_per_gpu, args.imgs_per_id, args.iters_per_epoch,
                                   rank, world, args.seed)
    loader = DataLoader(dataset, batch_size=args.ids_per_gpu * args.imgs_per_id, sampler=sampler,
                        num_workers=8, pin_memory=True, drop_last=True)

    model = Embedder(args.arch, args.embedding)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])

    distance = distances.CosineSimilarity()
    miner = pml_dist.DistributedMinerWrapper(
        miners.TripletMarginMiner(margin=args.margin, distance=distance, type_of_triplets="semihard"))
    loss_fn = pml_dist.DistributedLossWrapper(
        losses.TripletMarginLoss(margin=args.margin, distance=distance))

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    total = args.epochs * args.iters_per_epoch
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=total, pct_start=0.05)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"{len(dataset)} images / {len(dataset.class_to_idx)} identities, world {world}")
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, (x, y) in enumerate(loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            emb = model(x)
            pairs = miner(emb, y)
            loss = loss_fn(emb, y, pairs)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            if rank == 0 and it % 100 == 0:
                print(f"epoch {epoch} it {it} loss {loss.item():.4f} triplets {miner.miner.num_triplets} "
                      f"{time.time() - t0:.0f}s", flush=True)
        if rank == 0:
            acc = lfw_eval(model.module, args.lfw, device)
            print(f"epoch {epoch}: LFW {acc:.4f}", flush=True)
            torch.save({"model": model.module.state_dict(), "class_to_idx": dataset.class_to_idx, "epoch": epoch},
                       os.path.join(args.out, f"epoch{epoch:02d}.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
