"""Places-LT, decoupled training: stage 1 instance-balanced fine-tuning of an
ImageNet-pretrained ResNet-152, stage 2 classifier re-training (cRT) with
class-balanced sampling on frozen features.

    # stage 1
    torchrun --nproc_per_node=4 places_lt_crt.py --stage 1 --work-dir work/places_r152
    # stage 2
    torchrun --nproc_per_node=4 places_lt_crt.py --stage 2 --work-dir work/places_r152
"""
import argparse
import os
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, WeightedRandomSampler
from torch.utils.data.distributed import DistributedSampler
from torchvision import models, transforms


@dataclass
class StageCfg:
    epochs: int
    lr: float
    batch_size: int  # per GPU
    freeze_backbone: bool
    balanced: bool


@dataclass
class Cfg:
    img_root: str = "/data/places365_standard"
    list_dir: str = "/data/Places_LT"
    num_classes: int = 365
    workers: int = 8
    seed: int = 0
    stages: dict = field(default_factory=lambda: {
        1: StageCfg(epochs=30, lr=0.01, batch_size=64, freeze_backbone=False, balanced=False),
        2: StageCfg(epochs=10, lr=0.1, batch_size=64, freeze_backbone=True, balanced=True),
    })


class PlacesLT(Dataset):
    def __init__(self, cfg, split, train):
        self.root = cfg.img_root
        with open(os.path.join(cfg.list_dir, f"Places_LT_{split}.txt")) as f:
            rows = [r.split() for r in f if r.strip()]
        self.files = [r[0] for r in rows]
        self.labels = np.array([int(r[1]) for r in rows])
        norm = transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
        self.tf = (transforms.Compose([transforms.RandomResizedCrop(224), transforms.RandomHorizontalFlip(),
                                       transforms.ColorJitter(0.4, 0.4, 0.4), transforms.ToTensor(), norm])
                   if train else
                   transforms.Compose([transforms.Resize(256), transforms.CenterCrop(224),
                                       transforms.ToTensor(), norm]))

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        img = Image.open(os.path.join(self.root, self.files[i])).convert("RGB")
        return self.tf(img), int(self.labels[i])


def make_model(num_classes):
    net = models.resnet152(weights=models.ResNet152_Weights.IMAGENET1K_V1)
    net.fc = nn.Linear(net.fc.in_features, num_classes)
    return net


def make_train_loader(ds, sc, cfg, rank, world):
    if sc.balanced:
        counts = np.bincount(ds.labels, minlength=cfg.num_classes)
        w = 1.0 / counts[ds.labels]
        sampler = WeightedRandomSampler(torch.as_tensor(w, dtype=torch.double),
                                        num_samples=len(ds), replacement=True)
    else:
        sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=cfg.seed)
    return DataLoader(ds, batch_size=sc.batch_size, sampler=sampler, num_workers=cfg.workers,
                      pin_memory=True, drop_last=True), sampler


@torch.no_grad()
def test(net, ds, train_labels, cfg, rank, world, device):
    net.eval()
    mine = torch.utils.data.Subset(ds, range(rank, len(ds), world))
    loader = DataLoader(mine, batch_size=128, num_workers=cfg.workers, pin_memory=True)
    confusion = torch.zeros(cfg.num_classes, cfg.num_classes, dtype=torch.long, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        p = net(x).argmax(1)
        confusion.view(-1).index_add_(0, y * cfg.num_classes + p, torch.ones_like(y))
    dist.all_reduce(confusion)
    per_cls = (confusion.diag().float() / confusion.sum(1).clamp(min=1).float()).cpu().numpy()
    n = np.bincount(train_labels, minlength=cfg.num_classes)
    return {"acc": confusion.diag().sum().item() / confusion.sum().item(),
            "many": per_cls[n > 100].mean(), "medium": per_cls[(n <= 100) & (n >= 20)].mean(),
            "few": per_cls[n < 20].mean()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--stage", type=int, choices=[1, 2], required=True)
    ap.add_argument("--work-dir", required=True)
    args = ap.parse_args()
    cfg = Cfg()
    sc = cfg.stages[args.stage]

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(cfg.seed)
    np.random.seed(cfg.seed)

    train_set = PlacesLT(cfg, "train", train=True)
    test_set = PlacesLT(cfg, "test", train=False)
    loader, sampler = make_train_loader(train_set, sc, cfg, rank, world)

    net = make_model(cfg.num_classes)
    if args.stage == 2:
        sd = torch.load(os.path.join(args.work_dir, "stage1.pth"), map_location="cpu")["model"]
        net.load_state_dict(sd)
        net.fc.reset_parameters()
        for name, p in net.named_parameters():
            p.requires_grad = name.startswith("fc")
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net) if args.stage == 1 else net
    net.to(device)
    model = DDP(net, device_ids=[local_rank])

    # lrs in StageCfg are given for a total batch of 256
    base_lr = sc.lr * sc.batch_size * world / 256
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=base_lr, momentum=0.9, weight_decay=5e-4)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=sc.epochs * len(loader))

    for epoch in range(sc.epochs):
        if isinstance(sampler, DistributedSampler):
            sampler.set_epoch(epoch)
        model.train()
        if sc.freeze_backbone:
            for m in model.module.modules():
                if isinstance(m, nn.BatchNorm2d):
                    m.eval()
        for it, (x, y) in enumerate(loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            if rank == 0 and it % 100 == 0:
                print(f"stage{args.stage} ep{epoch} it{it}/{len(loader)} loss {loss.item():.4f}", flush=True)

        res = test(model.module, test_set, train_set.labels, cfg, rank, world, device)
        if rank == 0:
            print(f"stage{args.stage} epoch {epoch}: acc {100 * res['acc']:.2f} many {100 * res['many']:.2f} "
                  f"medium {100 * res['medium']:.2f} few {100 * res['few']:.2f}", flush=True)
            os.makedirs(args.work_dir, exist_ok=True)
            torch.save({"model": model.module.state_dict(), "epoch": epoch},
                       os.path.join(args.work_dir, f"stage{args.stage}.pth"))

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
