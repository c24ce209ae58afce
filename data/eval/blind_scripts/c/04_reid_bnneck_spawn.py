# -*- coding: utf-8 -*-
"""
行人重识别 baseline (ResNet50 + BNNeck, CE + Triplet), Market-1501
单机多卡, 用 mp.spawn 启动:
    python train_reid.py --cfg configs/market_r50.yaml --gpus 4
"""
import os
import glob
import re
import copy
import random
import argparse
from collections import defaultdict

import yaml
import numpy as np
from PIL import Image
from easydict import EasyDict

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.data import Dataset, DataLoader, Sampler
from torch.nn.parallel import DistributedDataParallel as DDP
import torchvision
import torchvision.transforms as T


def get_cfg():
    parser = argparse.ArgumentParser("ReID training")
    parser.add_argument("--cfg", default="configs/market_r50.yaml")
    parser.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    parser.add_argument("--port", type=str, default="29511")
    args = parser.parse_args()
    with open(args.cfg) as f:
        cfg = EasyDict(yaml.safe_load(f))
    cfg.gpus, cfg.port = args.gpus, args.port
    return cfg


# ------------------------- 数据 -------------------------
def read_market(root, sub):
    pattern = re.compile(r"([-\d]+)_c(\d)")
    items = []
    for p in sorted(glob.glob(os.path.join(root, sub, "*.jpg"))):
        pid, cam = map(int, pattern.search(p).groups())
        if pid == -1:
            continue  # 干扰图片
        items.append((p, pid, cam - 1))
    return items


class ReIDDataset(Dataset):
    def __init__(self, items, transform, relabel=False):
        if relabel:
            pids = sorted({pid for _, pid, _ in items})
            mapping = {p: i for i, p in enumerate(pids)}
            items = [(p, mapping[pid], cam) for p, pid, cam in items]
        self.items = items
        self.transform = transform

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        path, pid, cam = self.items[i]
        return self.transform(Image.open(path).convert("RGB")), pid, cam


class DistributedPKSampler(Sampler):
    """每个 batch 取 P 个 id, 每个 id K 张图; 所有 rank 用相同种子生成, 再按 rank 切分"""

    def __init__(self, items, batch_size, num_instances, rank, world_size, seed=0):
        self.batch_size, self.k = batch_size, num_instances
        self.rank, self.world_size, self.seed, self.epoch = rank, world_size, seed, 0
        self.index_dic = defaultdict(list)
        for idx, (_, pid, _) in enumerate(items):
            self.index_dic[pid].append(idx)
        self.pids = sorted(self.index_dic.keys())
        self.length = self._num_batches_per_rank() * batch_size

    def _num_batches_per_rank(self):
        n = sum(max(len(v), self.k) // self.k * self.k for v in self.index_dic.values())
        return n // self.batch_size // self.world_size

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        rng = random.Random(self.seed + self.epoch)
        chunks = []
        for pid in self.pids:
            idxs = list(self.index_dic[pid])
            if len(idxs) < self.k:
                idxs = [rng.choice(idxs) for _ in range(self.k)]
            rng.shuffle(idxs)
            chunks += [idxs[i:i + self.k] for i in range(0, len(idxs) - self.k + 1, self.k)]
        rng.shuffle(chunks)
        flat = [i for c in chunks for i in c]
        batches = [flat[i:i + self.batch_size] for i in range(0, len(flat) - self.batch_size + 1, self.batch_size)]
        nb = self._num_batches_per_rank()
        mine = batches[self.rank::self.world_size][:nb]
        return iter([i for b in mine for i in b])

    def __len__(self):
        return self.length


# ------------------------- 模型 -------------------------
class Baseline(nn.Module):
    def __init__(self, num_classes):
        super().__init__()
        resnet = torchvision.models.resnet50(weights="IMAGENET1K_V1")
        resnet.layer4[0].conv2.stride = (1, 1)  # last stride = 1
        resnet.layer4[0].downsample[0].stride = (1, 1)
        self.backbone = nn.Sequential(*list(resnet.children())[:-2])
        self.bnneck = nn.BatchNorm1d(2048)
        self.bnneck.bias.requires_grad_(False)
        self.classifier = nn.Linear(2048, num_classes, bias=False)

    def forward(self, x):
        feat = F.adaptive_avg_pool2d(self.backbone(x), 1).flatten(1)
        bn_feat = self.bnneck(feat)
        if not self.training:
            return bn_feat
        return self.classifier(bn_feat), feat


def triplet_loss(feat, pids, margin=0.3):
    dist_mat = torch.cdist(feat, feat)
    same = pids[:, None] == pids[None, :]
    ap = (dist_mat * same.float()).max(1)[0]
    an = (dist_mat + same.float() * 1e6).min(1)[0]
    return F.relu(ap - an + margin).mean()


@torch.no_grad()
def extract(model, loader, device):
    feats, pids, cams = [], [], []
    for img, pid, cam in loader:
        f = model(img.to(device)) + model(img.flip(-1).to(device))
        feats.append(F.normalize(f, dim=1).cpu())
        pids.append(pid)
        cams.append(cam)
    return torch.cat(feats), torch.cat(pids).numpy(), torch.cat(cams).numpy()


def eval_market(qf, qp, qc, gf, gp, gc):
    distmat = (1 - qf @ gf.t()).numpy()
    aps, cmc1 = [], 0
    for i in range(len(qp)):
        order = np.argsort(distmat[i])
        keep = ~((gp[order] == qp[i]) & (gc[order] == qc[i]))
        match = (gp[order] == qp[i])[keep]
        if not match.any():
            continue
        cmc1 += match[0]
        hits = np.where(match)[0]
        aps.append(np.mean([(j + 1) / (h + 1) for j, h in enumerate(hits)]))
    return float(np.mean(aps)), cmc1 / len(aps)


# ------------------------- 训练 -------------------------
def main_worker(gpu, ngpus, cfg):
    torch.cuda.set_device(gpu)
    device = torch.device("cuda", gpu)
    dist.init_process_group("nccl", init_method="tcp://127.0.0.1:" + cfg.port,
                            world_size=ngpus, rank=gpu)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(cfg.SEED + rank)

    train_tf = T.Compose([T.Resize((256, 128)), T.RandomHorizontalFlip(), T.Pad(10), T.RandomCrop((256, 128)),
                          T.ToTensor(), T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]),
                          T.RandomErasing(p=0.5)])
    test_tf = T.Compose([T.Resize((256, 128)), T.ToTensor(),
                         T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
    train_items = read_market(cfg.DATA_ROOT, "bounding_box_train")
    train_set = ReIDDataset(train_items, train_tf, relabel=True)
    num_classes = len({pid for _, pid, _ in train_set.items})
    sampler = DistributedPKSampler(train_set.items, cfg.IMS_PER_GPU, cfg.NUM_INSTANCE, rank, world_size, cfg.SEED)
    train_loader = DataLoader(train_set, batch_size=cfg.IMS_PER_GPU, sampler=sampler,
                              num_workers=cfg.WORKERS, pin_memory=True, drop_last=True)

    model = Baseline(num_classes)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[gpu])
    # 学习率 3.5e-4 对应总 batch 64
    lr = cfg.BASE_LR * cfg.IMS_PER_GPU * world_size / 64
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=5e-4)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[40, 70], gamma=0.1)
    ce = nn.CrossEntropyLoss(label_smoothing=0.1)

    if rank == 0:
        os.makedirs(cfg.OUTPUT_DIR, exist_ok=True)
        query = DataLoader(ReIDDataset(read_market(cfg.DATA_ROOT, "query"), test_tf), batch_size=128, num_workers=4)
        gallery = DataLoader(ReIDDataset(read_market(cfg.DATA_ROOT, "bounding_box_test"), test_tf),
                             batch_size=128, num_workers=4)

    best_map = 0.0
    for epoch in range(cfg.EPOCHS):
        sampler.set_epoch(epoch)
        model.train()
        loss_sum = torch.zeros(1, device=device)
        for it, (img, pid, _) in enumerate(train_loader):
            img, pid = img.to(device, non_blocking=True), pid.to(device, non_blocking=True)
            score, feat = model(img)
            loss = ce(score, pid) + triplet_loss(feat, pid)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            loss_sum += loss.detach()
        scheduler.step()
        dist.all_reduce(loss_sum)
        if rank == 0:
            print("Epoch {} loss {:.4f} lr {:.2e}".format(
                epoch, loss_sum.item() / world_size / len(train_loader), scheduler.get_last_lr()[0]))

        if (epoch + 1) % cfg.EVAL_PERIOD == 0:
            if rank == 0:
                net = model.module
                net.eval()
                qf, qp, qc = extract(net, query, device)
                gf, gp, gc = extract(net, gallery, device)
                mAP, r1 = eval_market(qf, qp, qc, gf, gp, gc)
                print("验证结果: mAP {:.2%} Rank-1 {:.2%}".format(mAP, r1))
                torch.save(net.state_dict(), os.path.join(cfg.OUTPUT_DIR, "last.pth"))
                if mAP > best_map:
                    best_map = mAP
                    torch.save(net.state_dict(), os.path.join(cfg.OUTPUT_DIR, "best.pth"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    cfg = get_cfg()
    mp.spawn(main_worker, nprocs=cfg.gpus, args=(cfg.gpus, cfg))
