# Human (COCO, 17 kpts) + animal (AP-10K, 17 kpts, different skeleton) pose with one
# shared HRNet-W32 backbone and a separate heatmap head per domain. Batches alternate
# between the domains, so only one head takes part in each step.
#
#   torchrun --nproc_per_node=8 13_human_animal_alternating_heads.py --cfg configs/human_animal_w32.yaml
import argparse
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler

from poselib.data import build_dataset
from poselib.models.hrnet import HRNetBackbone
from poselib.eval import keypoint_pck, flip_test

DOMAINS = ("human", "animal")


class TwoDomainPose(nn.Module):
    def __init__(self, width=32, num_joints=17):
        super().__init__()
        self.backbone = HRNetBackbone(width=width)
        self.heads = nn.ModuleDict({d: nn.Conv2d(width, num_joints, 1) for d in DOMAINS})

    def forward(self, x, domain):
        return self.heads[domain](self.backbone(x))


def load_pretrained(model, path):
    sd = torch.load(path, map_location="cpu")
    sd = sd.get("state_dict", sd)
    # checkpoints from the old DataParallel trainer carry a "module." prefix
    sd = {k[len("module."):] if k.startswith("module.") else k: v for k, v in sd.items()}
    sd = {k: v for k, v in sd.items() if not k.startswith("final_layer")}
    return model.backbone.load_state_dict(sd, strict=False)


def heatmap_loss(pred, target, weight):
    w = weight.reshape(*weight.shape[:2], 1, 1)
    return F.mse_loss(pred * w, target * w) * 0.5


@torch.no_grad()
def evaluate(net, loaders, device):
    net.eval()
    out = {}
    for domain, loader in loaders.items():
        hit = torch.zeros((), device=device)
        tot = torch.zeros((), device=device)
        for b in loader:
            img = b["img"].to(device, non_blocking=True)
            hm = flip_test(lambda x: net(x, domain), img, b["flip_index"][0].tolist())
            h, t = keypoint_pck(hm, b["joints"].to(device), b["joints_vis"].to(device),
                                b["bbox_size"].to(device), thr=0.05)
            hit += h
            tot += t
        dist.all_reduce(hit)
        dist.all_reduce(tot)
        out[domain] = (hit / tot.clamp(min=1)).item()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cfg", required=True)
    ap.add_argument("--resume", default=None)
    args = ap.parse_args()
    cfg = yaml.safe_load(open(args.cfg))

    local_rank = int(os.environ["LOCAL_RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(cfg["seed"])
    np.random.seed(cfg["seed"] + rank)

    if rank == 0:
        wandb.init(project="human-animal-pose", name=cfg["name"], config=cfg)
        os.makedirs(cfg["work_dir"], exist_ok=True)

    train_loaders, samplers, val_loaders = {}, {}, {}
    for d in DOMAINS:
        ds = build_dataset(cfg["data"][d]["train"], train=True)
        samplers[d] = DistributedSampler(ds, shuffle=True, seed=cfg["seed"])
        train_loaders[d] = DataLoader(ds, cfg["batch_per_gpu"], sampler=samplers[d], num_workers=cfg["workers"],
                                      pin_memory=True, drop_last=True, persistent_workers=True)
        vs = build_dataset(cfg["data"][d]["val"], train=False)
        val_loaders[d] = DataLoader(Subset(vs, range(rank, len(vs), world_size)), 64, shuffle=False,
                                    num_workers=4, pin_memory=True)
    # one epoch = one pass over the smaller domain, alternating human / animal
    steps_per_epoch = 2 * min(len(l) for l in train_loaders.values())

    model = TwoDomainPose(width=cfg["width"])
    if cfg.get("pretrained"):
        missing, _ = load_pretrained(model, cfg["pretrained"])
        if rank == 0:
            print("backbone keys not in pretrained:", len(missing))
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    # the head of the other domain gets no gradient in a step
    model = DDP(model, device_ids=[local_rank], find_unused_parameters=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=cfg["weight_decay"])
    total = cfg["epochs"] * steps_per_epoch
    sched = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / cfg["warmup"]) * 0.5 * (1 + math.cos(math.pi * s / total)))

    start_epoch = 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location=device)
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        sched.load_state_dict(ckpt["sched"])
        start_epoch = ckpt["epoch"]

    for epoch in range(start_epoch, cfg["epochs"]):
        for d in DOMAINS:
            samplers[d].set_epoch(epoch)
        iters = {d: iter(train_loaders[d]) for d in DOMAINS}
        model.train()
        t0 = time.time()
        for step in range(steps_per_epoch):
            domain = DOMAINS[step % 2]
            b = next(iters[domain])
            img = b["img"].to(device, non_blocking=True)
            target = b["target"].to(device, non_blocking=True)
            weight = b["target_weight"].to(device, non_blocking=True)
            loss = heatmap_loss(model(img, domain), target, weight)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            sched.step()
            if rank == 0 and step % 100 == 0:
                wandb.log({f"loss/{domain}": loss.item(), "lr": sched.get_last_lr()[0],
                           "epoch": epoch + step / steps_per_epoch})

        pck = evaluate(model.module, val_loaders, device)
        if rank == 0:
            print(f"epoch {epoch}: {pck} ({time.time() - t0:.0f}s)", flush=True)
            wandb.log({f"PCK@0.05/{d}": v for d, v in pck.items()} | {"epoch": epoch + 1})
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "sched": sched.state_dict(), "epoch": epoch + 1},
                       os.path.join(cfg["work_dir"], f"epoch_{epoch + 1:03d}.pth"))
        dist.barrier()

    if rank == 0:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
