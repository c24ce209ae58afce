"""
Embedding distillation for the face-unlock model.

Teacher: IResNet-100 trained with ArcFace on our internal set (frozen).
Student: MobileFaceNet (~1M params), trained with
    ArcFace margin loss on identities + cosine embedding distillation.

Usage:
    torchrun --nproc_per_node=8 09_face_embed_distill.py --rec /data/faces/train_rec \
        --teacher-weights models/iresnet100_arcface.pt --config cfg/mfn_distill.json
"""
import argparse
import json
import logging
import math
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from backbones import get_model           # insightface-style backbones package
from dataset import MXFaceDataset          # reads the .rec / .idx pair
from eval.verification import load_bin, test as verify

log = logging.getLogger("face_kd")

DEFAULT_CFG = {
    "num_classes": 93431,
    "embedding_size": 512,
    "batch_size": 256,
    "lr": 0.1,
    "momentum": 0.9,
    "weight_decay": 5e-4,
    "num_epoch": 24,
    "warmup_epoch": 1,
    "margin": 0.5,
    "scale": 64.0,
    "distill_weight": 50.0,
    "val_targets": ["lfw", "cfp_fp", "agedb_30"],
    "num_workers": 6,
    "output": "work_dirs/mfn_distill",
}


def load_teacher(name, weights, device="cuda:0"):
    net = get_model(name, fp16=False, num_features=512)
    net.load_state_dict(torch.load(weights, map_location="cpu"))
    net.eval()
    for p in net.parameters():
        p.requires_grad = False
    return net.to(device)


class ArcFaceHead(nn.Module):
    def __init__(self, emb, num_classes, s=64.0, m=0.5):
        super().__init__()
        self.weight = nn.Parameter(torch.normal(0, 0.01, (num_classes, emb)))
        self.s, self.m = s, m
        self.cos_m, self.sin_m = math.cos(m), math.sin(m)
        self.th = math.cos(math.pi - m)
        self.mm = math.sin(math.pi - m) * m

    def forward(self, emb, labels):
        cosine = F.linear(F.normalize(emb), F.normalize(self.weight)).clamp(-1 + 1e-7, 1 - 1e-7)
        sine = torch.sqrt(1.0 - cosine * cosine)
        phi = cosine * self.cos_m - sine * self.sin_m
        phi = torch.where(cosine > self.th, phi, cosine - self.mm)
        one_hot = torch.zeros_like(cosine).scatter_(1, labels.view(-1, 1), 1.0)
        logits = one_hot * phi + (1.0 - one_hot) * cosine
        return F.cross_entropy(logits * self.s, labels)


class StudentWithHead(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.backbone = get_model("mbf", fp16=False, num_features=cfg["embedding_size"])
        self.head = ArcFaceHead(cfg["embedding_size"], cfg["num_classes"], cfg["scale"], cfg["margin"])

    def forward(self, img, labels):
        emb = self.backbone(img)
        return emb, self.head(emb, labels)


def lr_lambda_factory(cfg, steps_per_epoch):
    warm = cfg["warmup_epoch"] * steps_per_epoch
    total = cfg["num_epoch"] * steps_per_epoch

    def f(step):
        if step < warm:
            return (step + 1) / warm
        return 0.5 * (1 + math.cos(math.pi * (step - warm) / (total - warm)))
    return f


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rec", required=True)
    parser.add_argument("--teacher-weights", required=True)
    parser.add_argument("--teacher-arch", default="r100")
    parser.add_argument("--config", default=None)
    args = parser.parse_args()
    cfg = dict(DEFAULT_CFG)
    if args.config:
        with open(args.config) as f:
            cfg.update(json.load(f))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR,
                        format="%(asctime)s-%(levelname)s %(message)s")

    train_set = MXFaceDataset(root_dir=args.rec, local_rank=local_rank)
    train_sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=2048)
    train_loader = DataLoader(train_set, batch_size=cfg["batch_size"], sampler=train_sampler,
                              num_workers=cfg["num_workers"], pin_memory=True, drop_last=True)

    teacher = load_teacher(args.teacher_arch, args.teacher_weights)
    model = StudentWithHead(cfg).cuda()
    model = DistributedDataParallel(model, device_ids=[local_rank], bucket_cap_mb=16)

    opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"] * cfg["batch_size"] * world_size / 512,
                          momentum=cfg["momentum"], weight_decay=cfg["weight_decay"])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda_factory(cfg, len(train_loader)))
    scaler = torch.cuda.amp.GradScaler(growth_interval=100)

    val_sets = {}
    if rank == 0:
        os.makedirs(cfg["output"], exist_ok=True)
        for name in cfg["val_targets"]:
            path = os.path.join(args.rec, name + ".bin")
            if os.path.exists(path):
                val_sets[name] = load_bin(path, (112, 112))

    best = {}
    global_step = 0
    for epoch in range(cfg["num_epoch"]):
        train_sampler.set_epoch(epoch)
        model.train()
        for img, label in train_loader:
            img = img.cuda(non_blocking=True)
            label = label.cuda(non_blocking=True)
            with torch.no_grad():
                t_emb = F.normalize(teacher(img).float())
            with torch.cuda.amp.autocast():
                s_emb, id_loss = model(img, label)
            kd_loss = (1.0 - F.cosine_similarity(s_emb.float(), t_emb, dim=1)).mean()
            loss = id_loss + cfg["distill_weight"] * kd_loss

            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            scaler.step(opt)
            scaler.update()
            sched.step()
            global_step += 1

            if global_step % 100 == 0:
                log.info(f"epoch {epoch} step {global_step} id {id_loss.item():.3f} "
                         f"kd {kd_loss.item():.4f} lr {sched.get_last_lr()[0]:.4f}")

        if rank == 0:
            backbone = model.module.backbone
            backbone.eval()
            for name, data in val_sets.items():
                acc, std, *_ = verify(data, backbone, 10, 10)
                best[name] = max(best.get(name, 0.0), float(np.mean(acc)))
                log.info(f"[{name}] epoch {epoch} acc {np.mean(acc):.4f}+-{std:.4f} best {best[name]:.4f}")
            torch.save(backbone.state_dict(), os.path.join(cfg["output"], f"mbf_ep{epoch}.pt"))
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "epoch": epoch},
                       os.path.join(cfg["output"], "checkpoint.pt"))
            backbone.train()
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
