"""Deep metric learning on CUB-200-2011 with batch-hard triplet loss and
hard-class mining.

Every `--mine-every` epochs the whole training set is embedded, class centroids
are computed and each class is paired with its nearest neighbouring classes.
Batches are then built from a seed class plus its hardest neighbours, P classes
x K images each.

    torchrun --nproc_per_node=4 05_triplet_hard_class_mining.py --root /data/CUB_200_2011/split
"""
import argparse
import os
import random
from collections import defaultdict

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torchvision import transforms as T


class EmbeddingNet(nn.Module):
    def __init__(self, embedding_dim=512, pretrained=True):
        super().__init__()
        weights = torchvision.models.ResNet50_Weights.IMAGENET1K_V2 if pretrained else None
        trunk = torchvision.models.resnet50(weights=weights)
        trunk.fc = nn.Identity()
        self.trunk = trunk
        self.embedding_dim = embedding_dim
        self.proj = nn.Linear(2048, embedding_dim)

    def forward(self, x):
        return F.normalize(self.proj(self.trunk(x)), dim=-1)


class DistributedHardClassBatchSampler:
    """Yields lists of indices (P classes x K images). The batch list is built
    from the same seed on every rank, and rank r takes batches r, r+W, ..."""

    def __init__(self, labels, p, k, num_batches, rank, world, seed=0):
        self.by_class = defaultdict(list)
        for i, y in enumerate(labels):
            self.by_class[y].append(i)
        self.classes = sorted(self.by_class)
        self.p, self.k = p, k
        self.num_batches = num_batches - num_batches % world
        self.rank, self.world = rank, world
        self.seed, self.epoch = seed, 0
        self.neighbours = {c: [] for c in self.classes}

    def set_neighbours(self, neighbours):
        self.neighbours = neighbours

    def set_epoch(self, epoch):
        self.epoch = epoch

    def _batch(self, rng):
        seed_cls = rng.choice(self.classes)
        cls = [seed_cls] + [c for c in self.neighbours[seed_cls][: self.p // 2]]
        while len(cls) < self.p:
            c = rng.choice(self.classes)
            if c not in cls:
                cls.append(c)
        batch = []
        for c in cls:
            pool = self.by_class[c]
            batch += rng.sample(pool, self.k) if len(pool) >= self.k else rng.choices(pool, k=self.k)
        return batch

    def __iter__(self):
        rng = random.Random(self.seed * 1000 + self.epoch)
        batches = [self._batch(rng) for _ in range(self.num_batches)]
        return iter(batches[self.rank::self.world])

    def __len__(self):
        return self.num_batches // self.world


def batch_hard_triplet(emb, labels, margin):
    d = torch.cdist(emb, emb)
    same = labels[:, None] == labels[None, :]
    eye = torch.eye(len(labels), dtype=torch.bool, device=emb.device)
    hardest_pos = (d * (same & ~eye)).max(1).values
    hardest_neg = d.masked_fill(same, float("inf")).min(1).values
    return F.relu(hardest_pos - hardest_neg + margin).mean()


@torch.no_grad()
def embed_all(model, dataset, rank, world, device, batch_size=256, workers=8):
    """Embeds the whole dataset: each rank does an (equal sized, padded) shard and
    the shards are all-gathered."""
    n = len(dataset)
    per_rank = (n + world - 1) // world
    shard = [(rank + world * j) % n for j in range(per_rank)]
    loader = DataLoader(Subset(dataset, shard), batch_size=batch_size, num_workers=workers, pin_memory=True)
    model.eval()
    local = torch.empty(per_rank, model.embedding_dim, device=device)
    pos = 0
    for x, _ in loader:
        out = model(x.to(device, non_blocking=True))
        local[pos:pos + len(out)] = out.float()
        pos += len(out)
    gathered = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(gathered, local)
    bank = torch.empty(n, local.size(1), device=device)
    for r in range(world):
        idx = torch.tensor([(r + world * j) % n for j in range(per_rank)], device=device)
        bank[idx] = gathered[r]
    return bank


def class_neighbours(bank, labels, num_neighbours):
    labels = torch.as_tensor(labels, device=bank.device)
    classes = labels.unique()
    cent = torch.stack([F.normalize(bank[labels == c].mean(0), dim=0) for c in classes])
    sim = cent @ cent.t()
    sim.fill_diagonal_(-2)
    nn_idx = sim.topk(num_neighbours, dim=1).indices
    return {int(c): [int(classes[j]) for j in nn_idx[i]] for i, c in enumerate(classes)}


def recall_at_k(bank, labels, ks=(1, 2, 4, 8)):
    labels = torch.as_tensor(labels, device=bank.device)
    sim = bank @ bank.t()
    sim.fill_diagonal_(-2)
    top = sim.topk(max(ks), dim=1).indices
    hit = labels[top] == labels[:, None]
    return {k: hit[:, :k].any(1).float().mean().item() for k in ks}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True, help="folder with train/ and test/ ImageFolder splits")
    ap.add_argument("--epochs", type=int, default=60)
    ap.add_argument("--p", type=int, default=16)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--batches-per-epoch", type=int, default=400)
    ap.add_argument("--margin", type=float, default=0.2)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--mine-every", type=int, default=2)
    ap.add_argument("--neighbours", type=int, default=8)
    ap.add_argument("--out", default="runs/cub_triplet")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    norm = T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train_tf = T.Compose([T.RandomResizedCrop(224, scale=(0.2, 1.0)), T.RandomHorizontalFlip(), T.ToTensor(), norm])
    eval_tf = T.Compose([T.Resize(256), T.CenterCrop(224), T.ToTensor(), norm])
    train_set = torchvision.datasets.ImageFolder(os.path.join(args.root, "train"), train_tf)
    train_eval = torchvision.datasets.ImageFolder(os.path.join(args.root, "train"), eval_tf)
    test_set = torchvision.datasets.ImageFolder(os.path.join(args.root, "test"), eval_tf)

    batch_sampler = DistributedHardClassBatchSampler(train_set.targets, args.p, args.k, args.batches_per_epoch,
                                                     rank, world, seed=17)
    train_loader = DataLoader(train_set, batch_sampler=batch_sampler, num_workers=8, pin_memory=True)

    model = EmbeddingNet().to(device)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.AdamW([
        {"params": model.module.trunk.parameters(), "lr": args.lr},
        {"params": model.module.proj.parameters(), "lr": args.lr * 10},
    ], weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[30, 45], gamma=0.1)

    best_r1 = 0.0
    for epoch in range(args.epochs):
        if epoch > 0 and epoch % args.mine_every == 0:
            bank = embed_all(model, train_eval, rank, world, device)
            batch_sampler.set_neighbours(class_neighbours(bank, train_eval.targets, args.neighbours))
        batch_sampler.set_epoch(epoch)

        model.train()
        running = torch.zeros(2, device=device)
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            emb = model(x)
            loss = batch_hard_triplet(emb, y, args.margin)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            running += torch.stack([loss.detach(), torch.ones((), device=device)])
        scheduler.step()
        dist.all_reduce(running)

        test_bank = embed_all(model, test_set, rank, world, device)
        rec = recall_at_k(test_bank, test_set.targets)
        if rank == 0:
            print(f"epoch {epoch} loss {(running[0] / running[1]).item():.4f} "
                  + " ".join(f"R@{k}={v:.4f}" for k, v in rec.items()), flush=True)
            os.makedirs(args.out, exist_ok=True)
            torch.save({"model": model.module.state_dict(), "epoch": epoch, "recall": rec},
                       os.path.join(args.out, "last.pth"))
            if rec[1] > best_r1:
                best_r1 = rec[1]
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "recall": rec},
                           os.path.join(args.out, "best.pth"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
