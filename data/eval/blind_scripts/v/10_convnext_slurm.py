# ConvNeXt-L fine-tuning for ad-creative policy classification (27 policy classes, multi-label).
#
# Submitted with sbatch on the research cluster (Slurm 23.02, pyxis/enroot container):
#
#   #!/bin/bash
#   #SBATCH --job-name=convnext-policy
#   #SBATCH --nodes=4
#   #SBATCH --ntasks-per-node=8
#   #SBATCH --gpus-per-node=8
#   #SBATCH --cpus-per-task=12
#   #SBATCH --time=2-00:00:00
#   export MASTER_ADDR=$(scontrol show hostnames $SLURM_JOB_NODELIST | head -n 1)
#   export MASTER_PORT=12802
#   srun --container-image=$IMG --container-mounts=/lustre:/lustre \
#        python convnext_policy.py --data /lustre/adpolicy/v9 --out /lustre/exp/convnext_l_policy_v9
#
# one Slurm task per GPU; rank / world size come from Slurm.
import argparse
import json
import os
import time

import numpy as np
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import wandb
from PIL import Image
from sklearn.metrics import average_precision_score
from timm.utils import ModelEmaV3
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms as T

NUM_CLASSES = 27


def setup_distributed():
    rank = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", 0)))
    world_size = int(os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", 1)))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", init_method="env://", rank=rank, world_size=world_size)
    return rank, world_size, local_rank


class CreativeSet(Dataset):
    def __init__(self, root, split, tf):
        with open(os.path.join(root, f"{split}.jsonl")) as f:
            self.items = [json.loads(l) for l in f]
        self.root, self.tf = root, tf

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        it = self.items[i]
        img = Image.open(os.path.join(self.root, "images", it["file"])).convert("RGB")
        y = torch.zeros(NUM_CLASSES)
        y[it["labels"]] = 1.0
        return self.tf(img), y, i


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="convnext_large.fb_in22k")
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--bs", type=int, default=48)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--layer-decay", type=float, default=0.8)
    p.add_argument("--ema", type=float, default=0.9998)
    return p.parse_args()


@torch.no_grad()
def run_eval(net, loader, device):
    net.eval()
    scores, targets, idxs = [], [], []
    for x, y, i in loader:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            scores.append(torch.sigmoid(net(x.to(device, non_blocking=True)).float()))
        targets.append(y.to(device))
        idxs.append(i.to(device))
    s, t, i = torch.cat(scores), torch.cat(targets), torch.cat(idxs)
    ws = dist.get_world_size()
    all_s = [torch.empty_like(s) for _ in range(ws)]
    all_t = [torch.empty_like(t) for _ in range(ws)]
    all_i = [torch.empty_like(i) for _ in range(ws)]
    dist.all_gather(all_s, s)
    dist.all_gather(all_t, t)
    dist.all_gather(all_i, i)
    s, t, i = torch.cat(all_s).cpu().numpy(), torch.cat(all_t).cpu().numpy(), torch.cat(all_i).cpu().numpy()
    _, keep = np.unique(i, return_index=True)  # drop the sampler's padding duplicates
    return float(average_precision_score(t[keep], s[keep], average="macro"))


def main():
    args = parse()
    rank, world, local_rank = setup_distributed()
    device = torch.device("cuda", local_rank)

    train_tf = T.Compose([T.RandomResizedCrop(384, scale=(0.5, 1.0)), T.RandomHorizontalFlip(),
                          T.TrivialAugmentWide(), T.ToTensor(),
                          T.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))])
    eval_tf = T.Compose([T.Resize(384), T.CenterCrop(384), T.ToTensor(),
                         T.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))])
    train_ds = CreativeSet(args.data, "train", train_tf)
    val_ds = CreativeSet(args.data, "val", eval_tf)
    train_sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True)
    val_sampler = DistributedSampler(val_ds, num_replicas=world, rank=rank, shuffle=False)
    train_dl = DataLoader(train_ds, args.bs, sampler=train_sampler, num_workers=10, pin_memory=True,
                          drop_last=True, persistent_workers=True)
    val_dl = DataLoader(val_ds, 64, sampler=val_sampler, num_workers=6, pin_memory=True)

    model = timm.create_model(args.model, pretrained=True, num_classes=NUM_CLASSES, drop_path_rate=0.3)
    model.to(device)
    ema = ModelEmaV3(model, decay=args.ema)
    param_groups = timm.optim.param_groups_layer_decay(model, weight_decay=0.05, layer_decay=args.layer_decay)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(param_groups, lr=args.lr)
    steps = args.epochs * len(train_dl)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=[args.lr * g.get("lr_scale", 1.0) for g in opt.param_groups],
                                                total_steps=steps, pct_start=0.05, anneal_strategy="cos")
    crit = nn.BCEWithLogitsLoss()

    ckpt_path = os.path.join(args.out, "last.pth")
    start = 0
    if os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, map_location="cpu")
        model.module.load_state_dict(ck["model"])
        ema.module.load_state_dict(ck["ema"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        start = ck["epoch"] + 1

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        wandb.init(project="ad-policy-vision", name=os.path.basename(args.out), config=vars(args), resume="allow")

    best = 0.0
    for epoch in range(start, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, (x, y, _) in enumerate(train_dl):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = crit(model(x).float(), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            sched.step()
            ema.update(model.module)
            if rank == 0 and it % 50 == 0:
                wandb.log({"train/loss": loss.item(), "train/lr": sched.get_last_lr()[0],
                           "train/img_s": (it + 1) * args.bs * world / (time.time() - t0)})

        map_model = run_eval(model.module, val_dl, device)
        map_ema = run_eval(ema.module, val_dl, device)
        if rank == 0:
            wandb.log({"val/mAP": map_model, "val/mAP_ema": map_ema, "epoch": epoch})
            state = {"model": model.module.state_dict(), "ema": ema.module.state_dict(),
                     "opt": opt.state_dict(), "sched": sched.state_dict(), "epoch": epoch}
            torch.save(state, ckpt_path)
            if max(map_model, map_ema) > best:
                best = max(map_model, map_ema)
                torch.save(state, os.path.join(args.out, "best.pth"))
        dist.barrier()

    if rank == 0:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
