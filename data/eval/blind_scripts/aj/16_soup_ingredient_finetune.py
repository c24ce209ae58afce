"""Train one model-soup ingredient: fine-tune CLIP ViT-B/32 on ImageNet with one
hyperparameter setting, and store the held-out (minival) logits of every epoch
so the greedy soup can later be built without re-running inference.

    torchrun --nproc_per_node=8 16_soup_ingredient_finetune.py --config soups/ingredient_07.yaml
"""
import argparse
import json
import math
import os

import numpy as np
import timm
import torch
import torch.distributed as dist
import torch.nn.functional as F
import yaml
from timm.data import create_transform
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision.datasets import ImageFolder
import wandb


def expected_calibration_error(probs, labels, n_bins=15):
    conf, pred = probs.max(1)
    acc = pred.eq(labels).float()
    bins = torch.linspace(0, 1, n_bins + 1, device=probs.device)
    ece = torch.zeros((), device=probs.device)
    for lo, hi in zip(bins[:-1], bins[1:]):
        m = (conf > lo) & (conf <= hi)
        if m.any():
            ece += m.float().mean() * (conf[m].mean() - acc[m].mean()).abs()
    return ece.item()


@torch.no_grad()
def predict(model, loader, device):
    model.eval()
    logits, labels = [], []
    for x, y in loader:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(x.to(device, non_blocking=True))
        logits.append(out.float())
        labels.append(y.to(device))
    return torch.cat(logits), torch.cat(labels)


def gather_predictions(logits, labels, world):
    out_logits = [torch.zeros_like(logits) for _ in range(world)]
    out_labels = [torch.zeros_like(labels) for _ in range(world)]
    dist.all_gather(out_logits, logits)
    dist.all_gather(out_labels, labels)
    return torch.cat(out_logits), torch.cat(out_labels)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    cfg = yaml.safe_load(open(ap.parse_args().config))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(cfg["seed"])

    mean, std = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
    train_tf = create_transform(224, is_training=True, auto_augment=cfg.get("randaug"),
                                mean=mean, std=std, interpolation="bicubic")
    eval_tf = create_transform(224, is_training=False, mean=mean, std=std, interpolation="bicubic")
    train_root = os.path.join(cfg["imagenet"], "train")
    train_full = ImageFolder(train_root, train_tf)
    eval_full = ImageFolder(train_root, eval_tf)

    # 2% of ImageNet-train held out as minival (fixed index file shared by all ingredients)
    minival_idx = np.load(cfg["minival_index_file"])
    held_out = set(minival_idx.tolist())
    train_idx = [i for i in range(len(train_full)) if i not in held_out]
    train_set = Subset(train_full, train_idx)
    minival = Subset(eval_full, minival_idx[rank::world].tolist())

    sampler = DistributedSampler(train_set, shuffle=True, seed=cfg["seed"], drop_last=True)
    train_loader = DataLoader(train_set, batch_size=cfg["batch_size"], sampler=sampler,
                              num_workers=cfg["workers"], pin_memory=True, drop_last=True,
                              persistent_workers=True)
    val_loader = DataLoader(minival, batch_size=256, num_workers=cfg["workers"], pin_memory=True)

    model = timm.create_model(cfg["model"], pretrained=True, num_classes=1000).to(device)
    model = DDP(model, device_ids=[local_rank])

    lr = cfg["lr"] * cfg["batch_size"] * world / 512
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=cfg["wd"])
    steps = cfg["epochs"] * len(train_loader)
    warmup = cfg["warmup_steps"]
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))

    out_dir = os.path.join(cfg["out_root"], cfg["name"])
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)
        wandb.init(project="soups", name=cfg["name"], config=cfg)

    history = []
    for epoch in range(cfg["epochs"]):
        sampler.set_epoch(epoch)
        model.train()
        for it, (x, y) in enumerate(train_loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(x), y, label_smoothing=cfg.get("smoothing", 0.0))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            if rank == 0 and it % 100 == 0:
                wandb.log({"train/loss": loss.item(), "lr": scheduler.get_last_lr()[0]})

        logits, labels = predict(model.module, val_loader, device)
        all_logits, all_labels = gather_predictions(logits, labels, world)

        if rank == 0:
            probs = all_logits.softmax(1)
            acc = probs.argmax(1).eq(all_labels).float().mean().item() * 100
            nll = F.cross_entropy(all_logits, all_labels).item()
            ece = expected_calibration_error(probs, all_labels)
            history.append({"epoch": epoch, "minival_acc": acc, "minival_nll": nll, "ece": ece})
            wandb.log({"minival/acc": acc, "minival/nll": nll, "minival/ece": ece, "epoch": epoch})
            print(f"[{cfg['name']}] epoch {epoch}: minival acc {acc:.2f} nll {nll:.4f} ece {ece:.4f}")
            torch.save({"model": model.module.state_dict(), "epoch": epoch, "cfg": cfg},
                       os.path.join(out_dir, f"epoch_{epoch}.pt"))
            torch.save({"logits": all_logits.half().cpu(), "labels": all_labels.cpu()},
                       os.path.join(out_dir, f"minival_logits_{epoch}.pt"))
            with open(os.path.join(out_dir, "history.json"), "w") as f:
                json.dump(history, f, indent=2)

    if rank == 0:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
