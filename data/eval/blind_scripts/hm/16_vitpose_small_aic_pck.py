"""ViTPose-S on AI Challenger (14 keypoints), 256x192.

Per-epoch validation reports the heatmap loss and the HRNet-style PCK accuracy
(normalised by the heatmap size); the full OKS evaluation is done offline.

    torchrun --nproc_per_node=8 16_vitpose_small_aic_pck.py --root /data/aic --out out/vitpose_s_aic
"""
import argparse
import logging
import os
import time

import numpy as np
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from aic.dataset import AICTopDownDataset

logger = logging.getLogger("vitpose_s")


def get_max_preds(batch_heatmaps):
    n, k, h, w = batch_heatmaps.shape
    flat = batch_heatmaps.reshape(n, k, -1)
    idx = np.argmax(flat, 2).reshape(n, k, 1)
    maxvals = np.amax(flat, 2).reshape(n, k, 1)
    preds = np.tile(idx, (1, 1, 2)).astype(np.float32)
    preds[:, :, 0] = preds[:, :, 0] % w
    preds[:, :, 1] = np.floor(preds[:, :, 1] / w)
    preds *= np.tile(maxvals > 0.0, (1, 1, 2))
    return preds, maxvals


def pck_accuracy(output, target, thr=0.5):
    """Returns (mean accuracy over joints with labels, number of such joints)."""
    pred, _ = get_max_preds(output)
    gt, _ = get_max_preds(target)
    h, w = output.shape[2], output.shape[3]
    norm = np.ones((pred.shape[0], 2)) * np.array([h, w]) / 10
    accs = []
    for j in range(output.shape[1]):
        d = []
        for b in range(pred.shape[0]):
            if gt[b, j, 0] > 1 and gt[b, j, 1] > 1:
                d.append(np.linalg.norm(pred[b, j] / norm[b] - gt[b, j] / norm[b]))
        if d:
            accs.append(np.mean(np.array(d) < thr))
    return (float(np.mean(accs)) if accs else 0.0), len(accs)


class ViTPoseSmall(nn.Module):
    def __init__(self, num_joints=14):
        super().__init__()
        self.backbone = timm.create_model("vit_small_patch16_224.augreg_in21k", pretrained=True,
                                          img_size=(256, 192), num_classes=0, global_pool="",
                                          class_token=False, drop_path_rate=0.1)
        dim = self.backbone.embed_dim
        self.decoder = nn.Sequential(
            nn.ConvTranspose2d(dim, 256, 4, 2, 1, bias=False), nn.BatchNorm2d(256), nn.ReLU(inplace=True),
            nn.ConvTranspose2d(256, 256, 4, 2, 1, bias=False), nn.BatchNorm2d(256), nn.ReLU(inplace=True),
            nn.Conv2d(256, num_joints, 1))

    def forward(self, x):
        t = self.backbone.forward_features(x)
        b, n, c = t.shape
        return self.decoder(t.transpose(1, 2).reshape(b, c, 16, 12))


@torch.no_grad()
def validate(model, loader):
    model.eval()
    loss_sum, acc_sum, acc_cnt, n = 0.0, 0.0, 0, 0
    for img, target, weight, _ in loader:
        img = img.cuda(non_blocking=True)
        target = target.cuda(non_blocking=True)
        weight = weight.cuda(non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(img)
        out = out.float()
        w = weight[..., None]
        loss_sum += 0.5 * F.mse_loss(out * w, target * w).item() * img.size(0)
        n += img.size(0)
        acc, cnt = pck_accuracy(out.cpu().numpy(), target.cpu().numpy())
        acc_sum += acc * cnt
        acc_cnt += cnt
    totals = torch.tensor([loss_sum, float(n), acc_sum, float(acc_cnt)], dtype=torch.float64)
    dist.all_reduce(totals, op=dist.ReduceOp.SUM)
    loss_sum, n, acc_sum, acc_cnt = totals.tolist()
    return loss_sum / max(n, 1), acc_sum / max(acc_cnt, 1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="/data/aic")
    ap.add_argument("--out", default="out/vitpose_s_aic")
    ap.add_argument("--epochs", type=int, default=210)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--wd", type=float, default=0.1)
    ap.add_argument("--workers", type=int, default=8)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARN,
                        format=f"%(asctime)s r{rank} %(message)s")

    train_set = AICTopDownDataset(args.root, "train", image_size=(192, 256), heatmap_size=(48, 64), train=True)
    val_set = AICTopDownDataset(args.root, "val", image_size=(192, 256), heatmap_size=(48, 64), train=False)
    train_sampler = DistributedSampler(train_set, shuffle=True)
    val_sampler = DistributedSampler(val_set, shuffle=False, drop_last=True)
    train_loader = DataLoader(train_set, args.batch, sampler=train_sampler, num_workers=args.workers,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(val_set, 128, sampler=val_sampler, num_workers=args.workers, pin_memory=True)

    model = ViTPoseSmall()
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).cuda()
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if p.ndim == 1 or "pos_embed" in name else decay).append(p)
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": args.wd},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=args.lr)
    warmup = torch.optim.lr_scheduler.LinearLR(optimizer, 1e-3, 1.0, total_iters=500)
    steps = torch.optim.lr_scheduler.MultiStepLR(optimizer, [170 * len(train_loader), 200 * len(train_loader)], 0.1)
    scheduler = torch.optim.lr_scheduler.ChainedScheduler([warmup, steps])

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best_acc = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for i, (img, target, weight, _) in enumerate(train_loader):
            img = img.cuda(non_blocking=True)
            target = target.cuda(non_blocking=True)
            weight = weight.cuda(non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = model(img)
            w = weight[..., None]
            loss = 0.5 * F.mse_loss(out.float() * w, target * w)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            if i % 100 == 0:
                logger.info("epoch %d it %d/%d loss %.6f", epoch, i, len(train_loader), loss.item())

        val_loss, val_acc = validate(model, val_loader)
        logger.info("epoch %d val loss %.6f acc %.4f (%.0fs)", epoch, val_loss, val_acc, time.time() - t0)
        if rank == 0:
            state = {"epoch": epoch + 1, "model": model.module.state_dict(), "optimizer": optimizer.state_dict()}
            torch.save(state, os.path.join(args.out, "latest.pth"))
            if val_acc > best_acc:
                best_acc = val_acc
                torch.save(model.module.state_dict(), os.path.join(args.out, "best_acc.pth"))
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
