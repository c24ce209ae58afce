"""
Multi-stage hint distillation (FitNets / "feature KD") for semantic
segmentation on Cityscapes: PSPNet-R101 teacher -> PSPNet-R18 student.
Each selected backbone stage of the student is mapped to the teacher's width
with a conv adapter and matched with an MSE on normalised features, in
addition to pixel-wise logit KD.

    torchrun --nproc_per_node=8 fitnet_seg.py --config configs/psp_r101_r18.yaml
"""
import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from seg.datasets import CityscapesDataset
from seg.models import build_pspnet

STAGE_CH = {"r18": [64, 128, 256, 512], "r101": [256, 512, 1024, 2048]}


def load_cfg():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--hint-stages", type=str, default="2,3",
                    help="comma separated backbone stages (0-3) to distill")
    a = ap.parse_args()
    with open(a.config) as f:
        cfg = yaml.safe_load(f)
    cfg["hint_stages"] = [int(s) for s in a.hint_stages.split(",")]
    return cfg


class HintStudent(nn.Module):
    def __init__(self, student, s_ch, t_ch, hint_stages):
        super().__init__()
        self.net = student
        self.hint_stages = hint_stages
        self.adapters = nn.ModuleList([
            nn.Sequential(nn.Conv2d(s, t, 3, padding=1, bias=False), nn.BatchNorm2d(t), nn.ReLU(inplace=True),
                          nn.Conv2d(t, t, 1))
            for s, t in zip(s_ch, t_ch)
        ])

    def forward(self, x):
        logits, feats = self.net(x, return_stages=True)
        hints = {i: self.adapters[i](feats[i]) for i in self.hint_stages}
        return logits, hints


def hint_loss(s, t):
    if s.shape[-2:] != t.shape[-2:]:
        s = F.interpolate(s, size=t.shape[-2:], mode="bilinear", align_corners=False)
    return F.mse_loss(F.normalize(s, dim=1), F.normalize(t, dim=1))


def pixel_kd(s_logits, t_logits, T):
    n, c, h, w = s_logits.shape
    s = s_logits.permute(0, 2, 3, 1).reshape(-1, c)
    t = t_logits.permute(0, 2, 3, 1).reshape(-1, c)
    return F.kl_div(F.log_softmax(s / T, 1), F.softmax(t / T, 1), reduction="batchmean") * T * T


@torch.no_grad()
def evaluate(model, loader, num_classes, device):
    model.eval()
    hist = torch.zeros(num_classes, num_classes, device=device, dtype=torch.long)
    for img, lbl in loader:
        img, lbl = img.to(device), lbl.to(device)
        logits, _ = model(img)
        logits = F.interpolate(logits, size=lbl.shape[-2:], mode="bilinear", align_corners=False)
        pred = logits.argmax(1)
        valid = lbl != 255
        hist += torch.bincount(num_classes * lbl[valid] + pred[valid],
                               minlength=num_classes ** 2).view(num_classes, num_classes)
    dist.all_reduce(hist)
    hist = hist.double()
    iou = hist.diag() / (hist.sum(0) + hist.sum(1) - hist.diag()).clamp(min=1)
    return iou.mean().item() * 100


def poly_lr(opt, base_lr, it, max_it, power=0.9):
    lr = base_lr * (1 - it / max_it) ** power
    for g in opt.param_groups:
        g["lr"] = lr * g.get("lr_mult", 1.0)
    return lr


def main():
    cfg = load_cfg()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(cfg.get("seed", 42))
    np.random.seed(cfg.get("seed", 42))

    train_set = CityscapesDataset(cfg["data_root"], split="train", crop=cfg["crop_size"], augment=True)
    val_set = CityscapesDataset(cfg["data_root"], split="val", crop=None, augment=False)
    train_sampler = DistributedSampler(train_set, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=cfg["batch_size"], sampler=train_sampler,
                              num_workers=cfg["workers"], pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=1, sampler=DistributedSampler(val_set, shuffle=False),
                            num_workers=2, pin_memory=True)

    teacher = build_pspnet("r101", num_classes=19)
    teacher.load_state_dict(torch.load(cfg["teacher_ckpt"], map_location="cpu")["state_dict"])
    teacher = teacher.to(device).eval()
    for p in teacher.parameters():
        p.requires_grad = False

    student = build_pspnet("r18", num_classes=19, pretrained_backbone=cfg["student_init"])
    model = HintStudent(student, STAGE_CH["r18"], STAGE_CH["r101"], cfg["hint_stages"])
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])

    backbone = [p for n, p in model.module.net.named_parameters() if n.startswith("backbone")]
    rest = [p for n, p in model.module.named_parameters() if not n.startswith("net.backbone")]
    opt = torch.optim.SGD([{"params": backbone, "lr_mult": 1.0},
                           {"params": rest, "lr_mult": 10.0}],
                          lr=cfg["lr"], momentum=0.9, weight_decay=5e-4)

    max_it = cfg["iters"]
    it, epoch, best = 0, 0, 0.0
    os.makedirs(cfg["work_dir"], exist_ok=True) if rank == 0 else None
    t0 = time.time()
    while it < max_it:
        train_sampler.set_epoch(epoch)
        model.train()
        for img, lbl in train_loader:
            if it >= max_it:
                break
            img, lbl = img.to(device, non_blocking=True), lbl.to(device, non_blocking=True)
            lr = poly_lr(opt, cfg["lr"], it, max_it)
            with torch.no_grad():
                t_logits, t_feats = teacher(img, return_stages=True)
            s_logits, s_hints = model(img)
            up = lambda z: F.interpolate(z, size=lbl.shape[-2:], mode="bilinear", align_corners=False)
            loss_seg = F.cross_entropy(up(s_logits), lbl, ignore_index=255)
            loss_kd = pixel_kd(s_logits, t_logits, cfg["kd_T"])
            loss_hint = sum(hint_loss(s_hints[i], t_feats[i]) for i in cfg["hint_stages"])
            loss = loss_seg + cfg["kd_weight"] * loss_kd + cfg["hint_weight"] * loss_hint
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            it += 1
            if rank == 0 and it % 50 == 0:
                print(f"it {it}/{max_it} lr {lr:.5f} seg {loss_seg.item():.3f} kd {loss_kd.item():.3f} "
                      f"hint {loss_hint.item():.4f} {(time.time() - t0) / it:.2f}s/it", flush=True)
            if it % cfg["eval_interval"] == 0 or it == max_it:
                miou = evaluate(model, val_loader, 19, device)
                model.train()
                if rank == 0:
                    print(f"[eval] it {it} mIoU {miou:.2f}", flush=True)
                    sd = model.module.net.state_dict()
                    torch.save({"iter": it, "state_dict": sd}, os.path.join(cfg["work_dir"], "latest.pth"))
                    if miou > best:
                        best = miou
                        torch.save({"iter": it, "state_dict": sd, "miou": miou},
                                   os.path.join(cfg["work_dir"], "best.pth"))
        epoch += 1

    if rank == 0:
        print(f"done, best mIoU {best:.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
