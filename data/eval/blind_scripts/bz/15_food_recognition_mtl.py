"""Food recognition with two auxiliary tasks from smaller datasets.

    main : Food-101 dish classification           (75,750 train images)
    aux1 : ingredient multi-label (Recipe1M subset, 353 ingredients, ~12k images)
    aux2 : calorie / macro regression (Nutrition5k overhead RGB, ~3.5k images)

A step concatenates one batch of each source and runs the shared EfficientNet
once; auxiliary losses are down-weighted.

    torchrun --standalone --nproc_per_node=4 15_food_recognition_mtl.py --cfg food_aux.yaml
"""
import argparse
import os
import time
from dataclasses import asdict, dataclass, field

import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms

from food_datasets import IngredientDataset, Nutrition5kRGB  # in-repo


@dataclass
class Config:
    food101_root: str = "/data/food-101"
    recipe_root: str = "/data/recipe1m_subset"
    n5k_root: str = "/data/nutrition5k"
    out_dir: str = "runs/food_aux"
    arch: str = "tf_efficientnetv2_s.in21k"
    img: int = 300
    bs_main: int = 48
    bs_aux: int = 16
    epochs: int = 30
    lr: float = 3e-4
    aux_weights: dict = field(default_factory=lambda: {"ingr": 0.5, "nutr": 0.2})
    workers: int = 8


class FoodMTL(nn.Module):
    def __init__(self, arch, n_dish=101, n_ingr=353):
        super().__init__()
        self.body = timm.create_model(arch, pretrained=True, num_classes=0, drop_path_rate=0.2)
        d = self.body.num_features
        self.dish = nn.Linear(d, n_dish)
        self.ingr = nn.Linear(d, n_ingr)
        self.nutr = nn.Sequential(nn.Linear(d, 256), nn.SiLU(), nn.Linear(256, 4))  # kcal, fat, carb, protein

    def forward(self, x, n_main, n_ingr):
        f = self.body(x)
        return (self.dish(f[:n_main]), self.ingr(f[n_main:n_main + n_ingr]),
                self.nutr(f[n_main + n_ingr:]))


def forever(loader, sampler=None):
    ep = 0
    while True:
        if sampler is not None:
            sampler.set_epoch(ep)
        for b in loader:
            yield b
        ep += 1


@torch.no_grad()
def evaluate(net, val_main, device, rank, world):
    net.eval()
    part = Subset(val_main, range(rank, len(val_main), world))
    s = torch.zeros(3, device=device)
    for x, y in DataLoader(part, batch_size=128, num_workers=6):
        x, y = x.to(device), y.to(device)
        logits, _, _ = net(x, x.size(0), 0)
        top5 = logits.topk(5, 1).indices
        s[0] += (top5[:, 0] == y).sum()
        s[1] += (top5 == y[:, None]).any(1).sum()
        s[2] += y.numel()
    dist.all_reduce(s)
    net.train()
    return {"top1": (s[0] / s[2]).item(), "top5": (s[1] / s[2]).item()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cfg", default=None)
    a = ap.parse_args()
    cfg = Config(**(yaml.safe_load(open(a.cfg)) if a.cfg else {}))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    mean, std = (0.5, 0.5, 0.5), (0.5, 0.5, 0.5)
    tf_train = transforms.Compose([transforms.RandomResizedCrop(cfg.img, scale=(0.35, 1)),
                                   transforms.RandomHorizontalFlip(), transforms.TrivialAugmentWide(),
                                   transforms.ToTensor(), transforms.Normalize(mean, std)])
    tf_val = transforms.Compose([transforms.Resize(int(cfg.img / 0.95)), transforms.CenterCrop(cfg.img),
                                 transforms.ToTensor(), transforms.Normalize(mean, std)])

    food_train = datasets.Food101(cfg.food101_root, split="train", transform=tf_train)
    food_val = datasets.Food101(cfg.food101_root, split="test", transform=tf_val)
    ingr_train = IngredientDataset(cfg.recipe_root, "train", transform=tf_train)
    n5k_train = Nutrition5kRGB(cfg.n5k_root, "train", transform=tf_train)

    main_sampler = DistributedSampler(food_train, shuffle=True)
    main_loader = DataLoader(food_train, batch_size=cfg.bs_main, sampler=main_sampler,
                             num_workers=cfg.workers, pin_memory=True, drop_last=True, persistent_workers=True)
    ingr_loader = DataLoader(ingr_train, batch_size=cfg.bs_aux, shuffle=True,
                             num_workers=2, pin_memory=True, drop_last=True, persistent_workers=True)
    n5k_loader = DataLoader(n5k_train, batch_size=cfg.bs_aux, shuffle=True,
                            num_workers=2, pin_memory=True, drop_last=True, persistent_workers=True)
    ingr_stream, n5k_stream = forever(ingr_loader), forever(n5k_loader)

    model = FoodMTL(cfg.arch).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.05)
    steps = cfg.epochs * len(main_loader)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=cfg.lr, total_steps=steps, pct_start=0.03)
    nutr_scale = torch.tensor([500.0, 30.0, 60.0, 30.0], device=device)

    if rank == 0:
        os.makedirs(cfg.out_dir, exist_ok=True)
        with open(os.path.join(cfg.out_dir, "config.yaml"), "w") as f:
            yaml.safe_dump(asdict(cfg), f)
    best = 0.0
    for epoch in range(cfg.epochs):
        main_sampler.set_epoch(epoch)
        t0 = time.time()
        for i, (xm, ym) in enumerate(main_loader):
            xi, yi = next(ingr_stream)
            xn, yn = next(n5k_stream)
            x = torch.cat([xm, xi, xn]).to(device, non_blocking=True)
            ym, yi, yn = ym.to(device), yi.to(device).float(), yn.to(device).float()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out_dish, out_ingr, out_nutr = model(x, xm.size(0), xi.size(0))
            l_dish = F.cross_entropy(out_dish.float(), ym, label_smoothing=0.1)
            l_ingr = F.binary_cross_entropy_with_logits(out_ingr.float(), yi)
            l_nutr = F.smooth_l1_loss(out_nutr.float(), yn / nutr_scale)
            loss = l_dish + cfg.aux_weights["ingr"] * l_ingr + cfg.aux_weights["nutr"] * l_nutr
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            if rank == 0 and i % 100 == 0:
                print(f"[{epoch}] {i}/{len(main_loader)} dish {l_dish.item():.3f} ingr {l_ingr.item():.4f} "
                      f"nutr {l_nutr.item():.4f}", flush=True)

        metrics = evaluate(model.module, food_val, device, rank, world)
        if rank == 0:
            print(f"epoch {epoch} {time.time() - t0:.0f}s val {metrics}", flush=True)
            state = {"model": model.module.state_dict(), "epoch": epoch, "metrics": metrics}
            torch.save(state, os.path.join(cfg.out_dir, "last.pt"))
            if metrics["top1"] > best:
                best = metrics["top1"]
                torch.save(state, os.path.join(cfg.out_dir, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
