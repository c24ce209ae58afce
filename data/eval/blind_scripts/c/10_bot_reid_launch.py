# -*- coding: utf-8 -*-
"""
Bag of Tricks ReID 基线 (ResNet50 + BNNeck + CenterLoss), MSMT17 / Market1501
分布式训练:
    python -m torch.distributed.launch --nproc_per_node=4 --master_port 29666 train_bot.py \
        --config_file configs/msmt17_r50.yml
"""
import os
import re
import glob
import time
import random
import logging
import argparse

import yaml
import numpy as np
from PIL import Image
from easydict import EasyDict

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist
from torch.utils.data import Dataset, DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.nn.parallel import DistributedDataParallel as DDP
import torchvision
import torchvision.transforms as T


def setup_logger(name, save_dir, rank):
    logger = logging.getLogger(name)
    logger.setLevel(logging.DEBUG)
    if rank > 0:
        return logger
    ch = logging.StreamHandler()
    ch.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s: %(message)s"))
    logger.addHandler(ch)
    if save_dir:
        fh = logging.FileHandler(os.path.join(save_dir, "train_log.txt"), mode="w")
        fh.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s: %(message)s"))
        logger.addHandler(fh)
    return logger


def set_seed(seed):
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)
    np.random.seed(seed)
    random.seed(seed)


class ImageDataset(Dataset):
    def __init__(self, root, transform, relabel=True):
        pat = re.compile(r"([-\d]+)_c(\d+)")
        items = []
        for p in sorted(glob.glob(os.path.join(root, "*.jpg"))):
            pid, cam = map(int, pat.search(os.path.basename(p)).groups())
            if pid >= 0:
                items.append((p, pid, cam))
        self.pid2label = {pid: i for i, pid in enumerate(sorted({x[1] for x in items}))}
        self.items = items
        self.transform = transform
        self.relabel = relabel

    def __len__(self):
        return len(self.items)

    def __getitem__(self, idx):
        p, pid, cam = self.items[idx]
        label = self.pid2label[pid] if self.relabel else pid
        return self.transform(Image.open(p).convert("RGB")), label, cam


class Backbone(nn.Module):
    def __init__(self, num_classes, pretrain_path=""):
        super().__init__()
        base = torchvision.models.resnet50()
        # 预训练权重提前下载到本地, 避免每个进程都去联网下载
        state = torch.load(pretrain_path, map_location="cpu")
        base.load_state_dict(state, strict=False)
        base.layer4[0].conv2.stride = (1, 1)
        base.layer4[0].downsample[0].stride = (1, 1)
        self.base = nn.Sequential(base.conv1, base.bn1, base.relu, base.maxpool,
                                  base.layer1, base.layer2, base.layer3, base.layer4)
        self.bottleneck = nn.BatchNorm1d(2048)
        self.bottleneck.bias.requires_grad_(False)
        self.classifier = nn.Linear(2048, num_classes, bias=False)
        nn.init.normal_(self.classifier.weight, std=0.001)

    def forward(self, x):
        global_feat = F.adaptive_avg_pool2d(self.base(x), 1).flatten(1)
        feat = self.bottleneck(global_feat)
        if self.training:
            return self.classifier(feat), global_feat
        return feat


class CenterLoss(nn.Module):
    def __init__(self, num_classes, feat_dim=2048):
        super().__init__()
        self.centers = nn.Parameter(torch.randn(num_classes, feat_dim))

    def forward(self, x, labels):
        c = self.centers[labels]
        return ((x - c) ** 2).sum(1).clamp(1e-12, 1e12).mean()


def hard_triplet(feat, labels, margin=0.3):
    d = torch.cdist(feat, feat)
    pos = labels[:, None].eq(labels[None, :])
    ap = (d - (~pos).float() * 1e6).max(1)[0]
    an = (d + pos.float() * 1e6).min(1)[0]
    return F.relu(ap - an + margin).mean()


@torch.no_grad()
def evaluate(model, query_loader, gallery_loader, device, max_rank=10):
    def extract(loader):
        feats, pids, cams = [], [], []
        for img, pid, cam in loader:
            feats.append(F.normalize(model(img.to(device)), dim=1).cpu())
            pids += pid.tolist()
            cams += cam.tolist()
        return torch.cat(feats), np.array(pids), np.array(cams)

    qf, q_pids, q_cams = extract(query_loader)
    gf, g_pids, g_cams = extract(gallery_loader)
    distmat = torch.cdist(qf, gf).numpy()
    all_cmc, all_ap = [], []
    for i in range(len(q_pids)):
        order = np.argsort(distmat[i])
        remove = (g_pids[order] == q_pids[i]) & (g_cams[order] == q_cams[i])
        matches = (g_pids[order] == q_pids[i])[~remove].astype(np.int32)
        if not matches.any():
            continue
        cmc = matches.cumsum()
        cmc[cmc > 1] = 1
        all_cmc.append(cmc[:max_rank])
        precision = matches.cumsum() / (np.arange(len(matches)) + 1)
        all_ap.append((precision * matches).sum() / matches.sum())
    return np.mean(all_ap), np.mean(all_cmc, axis=0)


def main():
    parser = argparse.ArgumentParser(description="ReID Baseline Training")
    parser.add_argument("--config_file", default="configs/msmt17_r50.yml", type=str)
    parser.add_argument("--local_rank", default=0, type=int)
    args = parser.parse_args()
    with open(args.config_file) as f:
        cfg = EasyDict(yaml.safe_load(f))

    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", args.local_rank)
    set_seed(cfg.SOLVER.SEED + rank)
    if rank == 0:
        os.makedirs(cfg.OUTPUT_DIR, exist_ok=True)
    logger = setup_logger("reid_baseline", cfg.OUTPUT_DIR, rank)
    logger.info("Running with config:\n%s", cfg)

    train_tf = T.Compose([T.Resize(cfg.INPUT.SIZE_TRAIN), T.RandomHorizontalFlip(0.5), T.Pad(10),
                          T.RandomCrop(cfg.INPUT.SIZE_TRAIN), T.ToTensor(),
                          T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]), T.RandomErasing(0.5)])
    train_set = ImageDataset(os.path.join(cfg.DATASETS.ROOT_DIR, "bounding_box_train"), train_tf)
    num_classes = len(train_set.pid2label)
    sampler = DistributedSampler(train_set, shuffle=True)
    loader = DataLoader(train_set, batch_size=cfg.SOLVER.IMS_PER_BATCH // world_size, sampler=sampler,
                        num_workers=cfg.DATALOADER.NUM_WORKERS, pin_memory=True, drop_last=True)

    test_tf = T.Compose([T.Resize(cfg.INPUT.SIZE_TEST), T.ToTensor(),
                         T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
    query_loader = DataLoader(ImageDataset(os.path.join(cfg.DATASETS.ROOT_DIR, "query"), test_tf, relabel=False),
                              batch_size=256, num_workers=4)
    gallery_loader = DataLoader(ImageDataset(os.path.join(cfg.DATASETS.ROOT_DIR, "bounding_box_test"), test_tf, relabel=False),
                                batch_size=256, num_workers=4)

    model = Backbone(num_classes, cfg.MODEL.PRETRAIN_PATH)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[args.local_rank], output_device=args.local_rank)
    center = CenterLoss(num_classes).to(device)
    center = DDP(center, device_ids=[args.local_rank])

    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad],
                                 lr=cfg.SOLVER.BASE_LR, weight_decay=cfg.SOLVER.WEIGHT_DECAY)
    optimizer_center = torch.optim.SGD(center.parameters(), lr=cfg.SOLVER.CENTER_LR)
    warmup = cfg.SOLVER.WARMUP_EPOCHS

    def lr_lambda(e):
        if e < warmup:
            return 0.1 + 0.9 * e / warmup
        return 0.1 ** sum(e >= m for m in cfg.SOLVER.STEPS)

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
    xent = nn.CrossEntropyLoss(label_smoothing=0.1)

    for epoch in range(cfg.SOLVER.MAX_EPOCHS):
        sampler.set_epoch(epoch)
        model.train()
        stats = torch.zeros(3, device=device)
        t0 = time.time()
        for n_iter, (img, target, _) in enumerate(loader):
            img, target = img.to(device, non_blocking=True), target.to(device, non_blocking=True)
            score, feat = model(img)
            loss = xent(score, target) + hard_triplet(feat, target) \
                + cfg.SOLVER.CENTER_LOSS_WEIGHT * center(feat, target)
            optimizer.zero_grad()
            optimizer_center.zero_grad()
            loss.backward()
            optimizer.step()
            for p in center.parameters():
                p.grad.data *= 1.0 / cfg.SOLVER.CENTER_LOSS_WEIGHT
            optimizer_center.step()
            acc = (score.argmax(1) == target).float().mean()
            stats += torch.stack([loss.detach(), acc, torch.ones((), device=device)])
            if (n_iter + 1) % cfg.SOLVER.LOG_PERIOD == 0:
                logger.info("Epoch[%d] Iteration[%d/%d] Loss: %.3f, Acc: %.3f, Base Lr: %.2e",
                            epoch, n_iter + 1, len(loader), loss.item(), acc.item(), scheduler.get_last_lr()[0])
        scheduler.step()
        dist.all_reduce(stats)
        logger.info("Epoch %d done. avg loss %.3f avg acc %.3f, %.1fs", epoch,
                    (stats[0] / stats[2]).item(), (stats[1] / stats[2]).item(), time.time() - t0)
        if rank == 0 and (epoch + 1) % cfg.SOLVER.CHECKPOINT_PERIOD == 0:
            torch.save(model.module.state_dict(),
                       os.path.join(cfg.OUTPUT_DIR, "resnet50_{}.pth".format(epoch + 1)))
        if (epoch + 1) % cfg.SOLVER.EVAL_PERIOD == 0:
            # 只在 rank0 上用完整的 query / gallery 评估, 其他进程等待
            if rank == 0:
                model.module.eval()
                mAP, cmc = evaluate(model.module, query_loader, gallery_loader, device)
                logger.info("Validation Results - Epoch: %d mAP: %.1f%% Rank-1: %.1f%% Rank-5: %.1f%%",
                            epoch, mAP * 100, cmc[0] * 100, cmc[4] * 100)
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
