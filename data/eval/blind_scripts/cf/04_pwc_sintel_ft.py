"""PWC-Net fine-tuning on MPI-Sintel (clean+final) with multi-scale robust loss.

Launch:
    torchrun --nproc_per_node=4 train_pwc_sintel.py --config configs/pwc_sintel.yaml
"""
import argparse
import os
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import ConcatDataset, DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

from pwc.models import PWCDCNet
from pwc.data import MpiSintel, FlowAugmentor

DEFAULTS = {
    "data_root": "/datasets/Sintel",
    "crop": [384, 768],
    "batch_size": 4,          # per GPU
    "lr": 3e-5,
    "weight_decay": 4e-4,
    "epochs": 300,
    "milestones": [100, 150, 200, 250],
    "div_flow": 20.0,
    "loss_weights": [0.32, 0.08, 0.02, 0.01, 0.005],
    "robust_eps": 0.01,
    "robust_q": 0.4,
    "pretrained": "weights/pwc_things.pth",
    "out_dir": "output/pwc_sintel",
    "workers": 6,
}


def load_config(path):
    cfg = dict(DEFAULTS)
    if path is not None:
        with open(path) as f:
            cfg.update(yaml.safe_load(f) or {})
    return argparse.Namespace(**cfg)


def multiscale_robust_loss(preds, flow_gt, weights, div_flow, eps, q):
    """Robust loss from the PWC-Net paper: sum over levels of (|f - f_gt| + eps)^q."""
    total = 0.0
    target = flow_gt / div_flow
    for pred, w in zip(preds, weights):
        h, w_ = pred.shape[-2:]
        scale_y = h / target.shape[-2]
        tgt = F.interpolate(target, (h, w_), mode="bilinear", align_corners=False) * scale_y
        diff = torch.norm(pred - tgt, p=1, dim=1)
        total = total + w * ((diff + eps) ** q).sum() / pred.shape[0]
    return total


@torch.no_grad()
def evaluate(model, loader, cfg, device):
    model.eval()
    epe_sum, n_pix = 0.0, 0
    for img1, img2, flow_gt, valid in loader:
        img1, img2 = img1.to(device), img2.to(device)
        flow_gt, valid = flow_gt.to(device), valid.to(device)
        H, W = img1.shape[-2:]
        h64, w64 = int(np.ceil(H / 64.0) * 64), int(np.ceil(W / 64.0) * 64)
        x1 = F.interpolate(img1, (h64, w64), mode="bilinear", align_corners=False)
        x2 = F.interpolate(img2, (h64, w64), mode="bilinear", align_corners=False)
        flow = model(x1, x2) * cfg.div_flow
        flow = F.interpolate(flow, (H, W), mode="bilinear", align_corners=False)
        flow[:, 0] *= W / float(w64)
        flow[:, 1] *= H / float(h64)
        epe = torch.norm(flow - flow_gt, p=2, dim=1)
        mask = valid > 0.5
        epe_sum += epe[mask].sum().item()
        n_pix += mask.sum().item()
    model.train()
    return epe_sum / max(n_pix, 1)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default=None)
    parser.add_argument("--seed", type=int, default=0)
    cli = parser.parse_args()
    cfg = load_config(cli.config)

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)

    random.seed(cli.seed)
    np.random.seed(cli.seed)
    torch.manual_seed(cli.seed)

    aug = FlowAugmentor(crop_size=cfg.crop, min_scale=-0.2, max_scale=0.6, do_flip=True)
    train_set = ConcatDataset([
        MpiSintel(cfg.data_root, split="train", dstype="clean", augmentor=aug),
        MpiSintel(cfg.data_root, split="train", dstype="final", augmentor=aug),
    ])
    val_set = ConcatDataset([
        MpiSintel(cfg.data_root, split="val", dstype="clean"),
        MpiSintel(cfg.data_root, split="val", dstype="final"),
    ])
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    val_sampler = DistributedSampler(val_set, shuffle=False)
    train_loader = DataLoader(train_set, batch_size=cfg.batch_size, sampler=train_sampler,
                              num_workers=cfg.workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=1, sampler=val_sampler, num_workers=2, pin_memory=True)

    model = PWCDCNet(md=4)
    if cfg.pretrained and os.path.isfile(cfg.pretrained):
        ckpt = torch.load(cfg.pretrained, map_location="cpu")
        model.load_state_dict(ckpt.get("model", ckpt))
    model.to(device)
    model = DistributedDataParallel(model, device_ids=[local_rank])

    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=cfg.milestones, gamma=0.5)

    writer = None
    if rank == 0:
        os.makedirs(cfg.out_dir, exist_ok=True)
        writer = SummaryWriter(os.path.join(cfg.out_dir, "tb"))

    best_epe = float("inf")
    global_step = 0
    for epoch in range(cfg.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        loss_acc = torch.zeros(2, device=device)
        for img1, img2, flow_gt, valid in train_loader:
            img1 = img1.to(device, non_blocking=True)
            img2 = img2.to(device, non_blocking=True)
            flow_gt = flow_gt.to(device, non_blocking=True)
            preds = model(img1, img2)
            loss = multiscale_robust_loss(preds, flow_gt, cfg.loss_weights, cfg.div_flow,
                                          cfg.robust_eps, cfg.robust_q)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            loss_acc[0] += loss.detach()
            loss_acc[1] += 1
            global_step += 1
        scheduler.step()

        dist.all_reduce(loss_acc)
        train_loss = (loss_acc[0] / loss_acc[1]).item()

        if (epoch + 1) % 5 == 0:
            val_epe = evaluate(model.module, val_loader, cfg, device)
            if rank == 0:
                print(f"[epoch {epoch:3d}] loss {train_loss:.3f}  sintel-val EPE {val_epe:.3f}")
                writer.add_scalar("val/epe", val_epe, epoch)
                state = {"epoch": epoch, "model": model.module.state_dict(),
                         "optimizer": optimizer.state_dict(), "val_epe": val_epe}
                torch.save(state, os.path.join(cfg.out_dir, "last.pth"))
                if val_epe < best_epe:
                    best_epe = val_epe
                    torch.save(state, os.path.join(cfg.out_dir, "best.pth"))
        if rank == 0:
            writer.add_scalar("train/loss", train_loss, epoch)
            writer.add_scalar("train/lr", scheduler.get_last_lr()[0], epoch)

    if rank == 0:
        writer.close()
        print(f"done, best EPE {best_epe:.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
