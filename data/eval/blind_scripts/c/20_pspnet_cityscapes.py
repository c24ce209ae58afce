# -*- coding: utf-8 -*-
"""
PSPNet (ResNet50, OS=8) Cityscapes 语义分割, mp.spawn 多进程训练 (参考 semseg 的写法)
    python train_psp.py --config config/cityscapes_pspnet50.yaml
多机时在 yaml 里改 world_size / rank / dist_url
"""
import os
import time
import random
import argparse

import cv2
import yaml
import numpy as np
from easydict import EasyDict

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.data import Dataset, DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.nn.parallel import DistributedDataParallel as DDP
import torchvision


def get_parser():
    parser = argparse.ArgumentParser(description="PyTorch Semantic Segmentation")
    parser.add_argument("--config", type=str, default="config/cityscapes_pspnet50.yaml")
    args = parser.parse_args()
    with open(args.config) as f:
        cfg = EasyDict(yaml.safe_load(f))
    return cfg


# ------------------------------ 模型 ------------------------------
class PPM(nn.Module):
    def __init__(self, in_dim, reduction_dim, bins=(1, 2, 3, 6)):
        super().__init__()
        self.features = nn.ModuleList([nn.Sequential(
            nn.AdaptiveAvgPool2d(b), nn.Conv2d(in_dim, reduction_dim, 1, bias=False),
            nn.BatchNorm2d(reduction_dim), nn.ReLU(inplace=True)) for b in bins])

    def forward(self, x):
        size = x.shape[-2:]
        return torch.cat([x] + [F.interpolate(f(x), size, mode="bilinear", align_corners=True)
                                for f in self.features], 1)


class PSPNet(nn.Module):
    def __init__(self, classes=19, zoom_factor=8):
        super().__init__()
        resnet = torchvision.models.resnet50(weights="IMAGENET1K_V1", replace_stride_with_dilation=[False, True, True])
        self.layer0 = nn.Sequential(resnet.conv1, resnet.bn1, resnet.relu, resnet.maxpool)
        self.layer1, self.layer2, self.layer3, self.layer4 = resnet.layer1, resnet.layer2, resnet.layer3, resnet.layer4
        self.ppm = PPM(2048, 512)
        self.cls = nn.Sequential(nn.Conv2d(4096, 512, 3, padding=1, bias=False), nn.BatchNorm2d(512),
                                 nn.ReLU(inplace=True), nn.Dropout2d(0.1), nn.Conv2d(512, classes, 1))
        self.aux = nn.Sequential(nn.Conv2d(1024, 256, 3, padding=1, bias=False), nn.BatchNorm2d(256),
                                 nn.ReLU(inplace=True), nn.Dropout2d(0.1), nn.Conv2d(256, classes, 1))

    def forward(self, x):
        h, w = x.shape[-2:]
        x = self.layer2(self.layer1(self.layer0(x)))
        x_tmp = self.layer3(x)
        x = self.cls(self.ppm(self.layer4(x_tmp)))
        x = F.interpolate(x, (h, w), mode="bilinear", align_corners=True)
        if self.training:
            aux = F.interpolate(self.aux(x_tmp), (h, w), mode="bilinear", align_corners=True)
            return x, aux
        return x


# ------------------------------ 数据 ------------------------------
class SemData(Dataset):
    """list 文件每行: 图片路径 标签路径 (相对 data_root)"""
    mean = np.array([0.485, 0.456, 0.406]) * 255
    std = np.array([0.229, 0.224, 0.225]) * 255

    def __init__(self, data_root, list_file, crop=(713, 713), train=True):
        with open(list_file) as f:
            self.items = [l.split() for l in f if l.strip()]
        self.root, self.crop, self.train = data_root, crop, train

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        img = cv2.imread(os.path.join(self.root, self.items[i][0]))[:, :, ::-1].astype(np.float32)
        lab = cv2.imread(os.path.join(self.root, self.items[i][1]), cv2.IMREAD_GRAYSCALE)
        if self.train:
            s = random.uniform(0.5, 2.0)
            img = cv2.resize(img, None, fx=s, fy=s, interpolation=cv2.INTER_LINEAR)
            lab = cv2.resize(lab, None, fx=s, fy=s, interpolation=cv2.INTER_NEAREST)
            ch, cw = self.crop
            ph, pw = max(ch - img.shape[0], 0), max(cw - img.shape[1], 0)
            img = cv2.copyMakeBorder(img, 0, ph, 0, pw, cv2.BORDER_CONSTANT, value=self.mean.tolist())
            lab = cv2.copyMakeBorder(lab, 0, ph, 0, pw, cv2.BORDER_CONSTANT, value=255)
            y, x = random.randint(0, img.shape[0] - ch), random.randint(0, img.shape[1] - cw)
            img, lab = img[y:y + ch, x:x + cw], lab[y:y + ch, x:x + cw]
            if random.random() < 0.5:
                img, lab = img[:, ::-1], lab[:, ::-1]
        img = (img - self.mean) / self.std
        return (torch.from_numpy(np.ascontiguousarray(img.transpose(2, 0, 1))).float(),
                torch.from_numpy(np.ascontiguousarray(lab)).long())


def intersection_union_gpu(pred, target, K, ignore=255):
    pred = pred.view(-1)
    target = target.view(-1)
    pred = pred[target != ignore]
    target = target[target != ignore]
    inter = torch.histc(pred[pred == target].float(), bins=K, min=0, max=K - 1)
    area_p = torch.histc(pred.float(), bins=K, min=0, max=K - 1)
    area_t = torch.histc(target.float(), bins=K, min=0, max=K - 1)
    return inter, area_p + area_t - inter, area_t


# ------------------------------ 训练 ------------------------------
def main_worker(gpu, cfg):
    cfg.rank = cfg.rank * cfg.ngpus_per_node + gpu
    torch.cuda.set_device(gpu)
    dist.init_process_group(backend="nccl", init_method=cfg.dist_url, world_size=cfg.world_size, rank=cfg.rank)
    main_process = cfg.rank == 0
    random.seed(cfg.manual_seed + cfg.rank)
    np.random.seed(cfg.manual_seed + cfg.rank)
    torch.manual_seed(cfg.manual_seed + cfg.rank)

    model = PSPNet(classes=cfg.classes)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).cuda(gpu)
    model = DDP(model, device_ids=[gpu])
    backbone = [model.module.layer0, model.module.layer1, model.module.layer2, model.module.layer3, model.module.layer4]
    new = [model.module.ppm, model.module.cls, model.module.aux]
    params = [{"params": m.parameters(), "lr": cfg.base_lr} for m in backbone] + \
             [{"params": m.parameters(), "lr": cfg.base_lr * 10} for m in new]
    optimizer = torch.optim.SGD(params, lr=cfg.base_lr, momentum=0.9, weight_decay=1e-4)
    criterion = nn.CrossEntropyLoss(ignore_index=255)

    # batch_size 为全局 batch, 每个进程分一份
    bs_per_gpu = cfg.batch_size // cfg.world_size
    train_data = SemData(cfg.data_root, cfg.train_list, (cfg.train_h, cfg.train_w), train=True)
    train_sampler = DistributedSampler(train_data)
    train_loader = DataLoader(train_data, batch_size=bs_per_gpu, sampler=train_sampler,
                              num_workers=cfg.workers // cfg.ngpus_per_node, pin_memory=True, drop_last=True)
    val_data = SemData(cfg.data_root, cfg.val_list, train=False)
    val_loader = DataLoader(val_data, batch_size=1, sampler=DistributedSampler(val_data, shuffle=False),
                            num_workers=2, pin_memory=True)
    max_iter = cfg.epochs * len(train_loader)
    if main_process:
        os.makedirs(cfg.save_path, exist_ok=True)

    for epoch in range(cfg.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        end = time.time()
        for i, (x, y) in enumerate(train_loader):
            cur = epoch * len(train_loader) + i
            lr = cfg.base_lr * (1 - cur / max_iter) ** 0.9
            for k, g in enumerate(optimizer.param_groups):
                g["lr"] = lr if k < len(backbone) else lr * 10
            x, y = x.cuda(gpu, non_blocking=True), y.cuda(gpu, non_blocking=True)
            out, aux = model(x)
            loss = criterion(out, y) + cfg.aux_weight * criterion(aux, y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if main_process and (i + 1) % cfg.print_freq == 0:
                print("Epoch: [{}/{}][{}/{}] Loss {:.4f} LR {:.5f} Batch {:.3f}s".format(
                    epoch + 1, cfg.epochs, i + 1, len(train_loader), loss.item(), lr, time.time() - end))
            end = time.time()

        if main_process:
            torch.save({"epoch": epoch + 1, "state_dict": model.module.state_dict(),
                        "optimizer": optimizer.state_dict()}, os.path.join(cfg.save_path, "train_epoch_last.pth"))
        if (epoch + 1) % cfg.eval_freq == 0:
            model.eval()
            stat = torch.zeros(3, cfg.classes, device="cuda")
            with torch.no_grad():
                for x, y in val_loader:
                    pred = model(x.cuda(gpu)).argmax(1)
                    i_, u_, t_ = intersection_union_gpu(pred, y.cuda(gpu), cfg.classes)
                    stat += torch.stack([i_, u_, t_])
            dist.all_reduce(stat)
            iou = stat[0] / (stat[1] + 1e-10)
            if main_process:
                print("Val result: mIoU {:.4f} allAcc {:.4f}".format(iou.mean().item(),
                                                                     (stat[0].sum() / stat[2].sum()).item()))

    dist.destroy_process_group()


def main():
    cfg = get_parser()
    cfg.ngpus_per_node = torch.cuda.device_count()
    cfg.world_size = cfg.ngpus_per_node * cfg.world_size  # yaml 里的 world_size 是机器数
    mp.spawn(main_worker, nprocs=cfg.ngpus_per_node, args=(cfg))


if __name__ == "__main__":
    main()
