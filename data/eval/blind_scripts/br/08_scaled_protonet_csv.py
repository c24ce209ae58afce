"""ProtoNet with learned metric scaling (Oreshkin et al., TADAM, sec. 2.1).

mini-ImageNet with the Ravi & Larochelle CSV split (images/ + train.csv/val.csv/test.csv).

    torchrun --nproc_per_node=4 08_scaled_protonet_csv.py data.root=/data/miniImageNet
"""
import csv
import logging
import os
import sys
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torchvision import transforms as T

logger = logging.getLogger(__name__)


@dataclass
class Config:
    root: str = "/data/miniImageNet"
    out: str = "outputs/scaled_proto"
    way: int = 5
    shot: int = 5
    query: int = 15
    train_way: int = 15
    init_scale: float = 10.0
    epochs: int = 120
    episodes: int = 500
    val_episodes: int = 600
    lr: float = 5e-4
    milestones: list = field(default_factory=lambda: [60, 90])
    workers: int = 8
    seed: int = 7


def parse_overrides(cfg, argv):
    """key=value overrides, e.g. `shot=1 data.root=/x` (the prefix before the dot is ignored)."""
    for arg in argv:
        key, value = arg.split("=", 1)
        key = key.split(".")[-1]
        old = getattr(cfg, key)
        setattr(cfg, key, type(old)(value) if not isinstance(old, list) else
                [int(v) for v in value.split(",")])
    return cfg


class MiniImageNetCSV(Dataset):
    def __init__(self, root, split, augment):
        with open(os.path.join(root, f"{split}.csv")) as f:
            rows = list(csv.reader(f))[1:]
        wnids = sorted({wnid for _, wnid in rows})
        self.index = {w: i for i, w in enumerate(wnids)}
        self.files = [os.path.join(root, "images", name) for name, _ in rows]
        self.labels = np.array([self.index[w] for _, w in rows])
        norm = T.Normalize([0.472, 0.453, 0.410], [0.277, 0.268, 0.285])
        self.tf = (T.Compose([T.RandomResizedCrop(84, scale=(0.5, 1.0)), T.RandomHorizontalFlip(),
                              T.ToTensor(), norm]) if augment else
                   T.Compose([T.Resize((84, 84)), T.ToTensor(), norm]))

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        return self.tf(Image.open(self.files[i]).convert("RGB")), self.labels[i]


class EpisodeSampler:
    def __init__(self, labels, n_episodes, way, per_class, seed):
        self.cls_idx = [np.flatnonzero(labels == c) for c in range(labels.max() + 1)]
        self.n_episodes, self.way, self.per_class = n_episodes, way, per_class
        self.rng = np.random.default_rng(seed)

    def __len__(self):
        return self.n_episodes

    def __iter__(self):
        for _ in range(self.n_episodes):
            cls = self.rng.permutation(len(self.cls_idx))[:self.way]
            idx = np.stack([self.rng.choice(self.cls_idx[c], self.per_class, replace=False)
                            for c in cls], axis=1)  # [per_class, way]
            yield idx.reshape(-1).tolist()


class ScaledProtoNet(nn.Module):
    def __init__(self, init_scale):
        super().__init__()

        def block(i, o):
            return nn.Sequential(nn.Conv2d(i, o, 3, padding=1), nn.BatchNorm2d(o), nn.ReLU(),
                                 nn.MaxPool2d(2))

        self.encoder = nn.Sequential(block(3, 64), block(64, 64), block(64, 64), block(64, 64))
        self.scale = nn.Parameter(torch.tensor(init_scale))

    def forward(self, x):
        return self.encoder(x).flatten(1)


def sq_dist(query, protos):
    return (query.unsqueeze(1) - protos.unsqueeze(0)).pow(2).sum(-1)


def episode_logits(model, images, way, shot):
    emb = model(images)
    n_s = way * shot
    protos = emb[:n_s].view(shot, way, -1).mean(0)
    return -model.scale * sq_dist(emb[n_s:], protos)


@torch.no_grad()
def meta_eval(model, loader, way, shot, query, device):
    model.eval()
    y = torch.arange(way, device=device).repeat(query)
    accs = torch.cat([(episode_logits(model, x.to(device), way, shot).argmax(1) == y).float()
                      .mean().view(1) for x, _ in loader])
    model.train()
    gathered = [torch.empty_like(accs) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, accs)
    accs = torch.cat(gathered)
    return accs.mean().item(), (1.96 * accs.std(unbiased=False) / accs.numel() ** 0.5).item()


def main():
    cfg = parse_overrides(Config(), sys.argv[1:])
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR,
                        format=f"[rank{rank}] %(asctime)s %(message)s")
    torch.manual_seed(cfg.seed)

    train_set = MiniImageNetCSV(cfg.root, "train", augment=True)
    val_set = MiniImageNetCSV(cfg.root, "val", augment=False)
    train_loader = DataLoader(train_set, num_workers=cfg.workers, pin_memory=True,
                              batch_sampler=EpisodeSampler(train_set.labels, cfg.episodes, cfg.train_way,
                                                           cfg.shot + cfg.query, seed=cfg.seed + rank))
    val_loader = DataLoader(val_set, num_workers=cfg.workers, pin_memory=True,
                            batch_sampler=EpisodeSampler(val_set.labels, cfg.val_episodes // world,
                                                         cfg.way, cfg.shot + cfg.query,
                                                         seed=10_000 + rank))

    model = ScaledProtoNet(cfg.init_scale).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, cfg.milestones, gamma=0.1)

    if rank == 0:
        os.makedirs(cfg.out, exist_ok=True)
        logger.info("config: %s", asdict(cfg))

    y_train = torch.arange(cfg.train_way, device=device).repeat(cfg.query)
    best = -1.0
    for epoch in range(cfg.epochs):
        tic = time.time()
        loss_sum = torch.zeros(2, device=device)
        for images, _ in train_loader:
            logits = episode_logits(model, images.to(device, non_blocking=True), cfg.train_way, cfg.shot)
            loss = F.cross_entropy(logits, y_train)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            loss_sum += torch.stack([loss.detach(), torch.ones((), device=device)])
        scheduler.step()
        dist.all_reduce(loss_sum)

        acc, ci = meta_eval(model, val_loader, cfg.way, cfg.shot, cfg.query, device)
        logger.info("epoch %d loss %.4f scale %.3f val %.2f +- %.2f (%.0fs)", epoch, (loss_sum[0] / loss_sum[1]).item(),
                    model.module.scale.item(), 100 * acc, 100 * ci, time.time() - tic)
        if rank == 0:
            state = {"model": model.module.state_dict(), "epoch": epoch, "acc": acc,
                     "cfg": asdict(cfg)}
            torch.save(state, os.path.join(cfg.out, "last.pt"))
            if acc > best:
                best = acc
                torch.save(state, os.path.join(cfg.out, "best.pt"))
        dist.barrier()

    logger.info("best val acc %.2f", 100 * best)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
