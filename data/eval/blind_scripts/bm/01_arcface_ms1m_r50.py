#!/usr/bin/env python
"""ArcFace training on MS1MV3 (RetinaFace-cleaned) with an IResNet-50 backbone.

Data is the usual insightface train.rec / train.idx pair plus the *.bin
verification sets (lfw, cfp_fp, agedb_30) in the same folder.
"""
import argparse
import logging
import math
import numbers
import os
import pickle
import time

import mxnet as mx
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from torchvision import transforms


def get_args():
    parser = argparse.ArgumentParser(description="ArcFace MS1MV3 training")
    parser.add_argument("--local_rank", type=int, default=0, help="local_rank")
    parser.add_argument("--rec", type=str, default="/data/ms1m-retinaface-t1")
    parser.add_argument("--num-classes", type=int, default=93431)
    parser.add_argument("--embedding-size", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=128, help="per-GPU batch size")
    parser.add_argument("--lr", type=float, default=0.1, help="lr for a global batch of 512")
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--weight-decay", type=float, default=5e-4)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--decay-epochs", type=int, nargs="+", default=[10, 16, 18])
    parser.add_argument("--margin", type=float, default=0.5)
    parser.add_argument("--scale", type=float, default=64.0)
    parser.add_argument("--val-targets", nargs="+", default=["lfw", "cfp_fp", "agedb_30"])
    parser.add_argument("--output", type=str, default="work_dirs/ms1mv3_r50")
    parser.add_argument("--num-workers", type=int, default=4)
    parser.add_argument("--fp16", action="store_true")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--log-interval", type=int, default=100)
    return parser.parse_args()


# ----------------------------------------------------------------------------- data
class MXFaceDataset(Dataset):
    def __init__(self, root_dir):
        super().__init__()
        self.transform = transforms.Compose([
            transforms.ToPILImage(),
            transforms.RandomHorizontalFlip(),
            transforms.ToTensor(),
            transforms.Normalize(mean=[0.5, 0.5, 0.5], std=[0.5, 0.5, 0.5]),
        ])
        path_imgrec = os.path.join(root_dir, "train.rec")
        path_imgidx = os.path.join(root_dir, "train.idx")
        self.imgrec = mx.recordio.MXIndexedRecordIO(path_imgidx, path_imgrec, "r")
        s = self.imgrec.read_idx(0)
        header, _ = mx.recordio.unpack(s)
        if header.flag > 0:
            self.imgidx = np.array(range(1, int(header.label[0])))
        else:
            self.imgidx = np.array(list(self.imgrec.keys))

    def __getitem__(self, index):
        idx = self.imgidx[index]
        s = self.imgrec.read_idx(idx)
        header, img = mx.recordio.unpack(s)
        label = header.label
        if not isinstance(label, numbers.Number):
            label = label[0]
        label = torch.tensor(label, dtype=torch.long)
        sample = mx.image.imdecode(img).asnumpy()
        return self.transform(sample), label

    def __len__(self):
        return len(self.imgidx)


def load_bin(path, image_size=(112, 112)):
    with open(path, "rb") as f:
        bins, issame_list = pickle.load(f, encoding="bytes")
    data = torch.empty((len(issame_list) * 2, 3, image_size[0], image_size[1]))
    for idx in range(len(issame_list) * 2):
        img = mx.image.imdecode(bins[idx])
        if img.shape[1] != image_size[0]:
            img = mx.image.resize_short(img, image_size[0])
        img = torch.from_numpy(img.asnumpy()).permute(2, 0, 1).float()
        data[idx] = (img / 255.0 - 0.5) / 0.5
    return data, np.array(issame_list, dtype=bool)


# ----------------------------------------------------------------------------- model
def conv3x3(in_planes, out_planes, stride=1):
    return nn.Conv2d(in_planes, out_planes, kernel_size=3, stride=stride, padding=1, bias=False)


class IBasicBlock(nn.Module):
    def __init__(self, inplanes, planes, stride=1, downsample=None):
        super().__init__()
        self.bn1 = nn.BatchNorm2d(inplanes, eps=1e-05)
        self.conv1 = conv3x3(inplanes, planes)
        self.bn2 = nn.BatchNorm2d(planes, eps=1e-05)
        self.prelu = nn.PReLU(planes)
        self.conv2 = conv3x3(planes, planes, stride)
        self.bn3 = nn.BatchNorm2d(planes, eps=1e-05)
        self.downsample = downsample

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.bn1(x)
        out = self.conv1(out)
        out = self.prelu(self.bn2(out))
        out = self.bn3(self.conv2(out))
        return out + identity


class IResNet(nn.Module):
    def __init__(self, layers, num_features=512, fp16=False):
        super().__init__()
        self.fp16 = fp16
        self.inplanes = 64
        self.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(64, eps=1e-05)
        self.prelu = nn.PReLU(64)
        self.layer1 = self._make_layer(64, layers[0])
        self.layer2 = self._make_layer(128, layers[1])
        self.layer3 = self._make_layer(256, layers[2])
        self.layer4 = self._make_layer(512, layers[3])
        self.bn2 = nn.BatchNorm2d(512, eps=1e-05)
        self.fc = nn.Linear(512 * 7 * 7, num_features)
        self.features = nn.BatchNorm1d(num_features, eps=1e-05)
        nn.init.constant_(self.features.weight, 1.0)
        self.features.weight.requires_grad = False

    def _make_layer(self, planes, blocks, stride=2):
        downsample = nn.Sequential(
            nn.Conv2d(self.inplanes, planes, kernel_size=1, stride=stride, bias=False),
            nn.BatchNorm2d(planes, eps=1e-05),
        )
        layers = [IBasicBlock(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes
        layers += [IBasicBlock(planes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x):
        with torch.cuda.amp.autocast(self.fp16):
            x = self.prelu(self.bn1(self.conv1(x)))
            x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
            x = torch.flatten(self.bn2(x), 1)
        x = self.fc(x.float() if self.fp16 else x)
        return self.features(x)


class ArcFace(nn.Module):
    def __init__(self, in_features, out_features, s=64.0, m=0.5):
        super().__init__()
        self.s = s
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        nn.init.normal_(self.weight, std=0.01)
        self.cos_m, self.sin_m = math.cos(m), math.sin(m)
        self.th = math.cos(math.pi - m)
        self.mm = math.sin(math.pi - m) * m

    def forward(self, embeddings, labels):
        cosine = F.linear(F.normalize(embeddings), F.normalize(self.weight)).clamp(-1, 1)
        sine = torch.sqrt((1.0 - cosine.pow(2)).clamp(min=1e-6))
        phi = cosine * self.cos_m - sine * self.sin_m
        phi = torch.where(cosine > self.th, phi, cosine - self.mm)
        one_hot = torch.zeros_like(cosine).scatter_(1, labels.view(-1, 1), 1.0)
        return (one_hot * phi + (1.0 - one_hot) * cosine) * self.s


class FaceModel(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.backbone = IResNet([3, 4, 14, 3], args.embedding_size, fp16=args.fp16)
        self.head = ArcFace(args.embedding_size, args.num_classes, s=args.scale, m=args.margin)

    def forward(self, images, labels):
        return self.head(self.backbone(images), labels)


# ----------------------------------------------------------------------------- eval
@torch.no_grad()
def verification(backbone, data, issame, device, batch_size=256, nfolds=10):
    backbone.eval()
    embs = []
    for i in range(0, data.shape[0], batch_size):
        x = data[i:i + batch_size].to(device)
        e = backbone(x) + backbone(torch.flip(x, dims=[3]))
        embs.append(F.normalize(e).cpu())
    embs = torch.cat(embs).numpy()
    dist_ = np.sum((embs[0::2] - embs[1::2]) ** 2, axis=1)
    thresholds = np.arange(0, 4, 0.01)
    folds = np.array_split(np.random.RandomState(0).permutation(len(issame)), nfolds)
    accs = []
    for k in range(nfolds):
        test = folds[k]
        train = np.concatenate([folds[j] for j in range(nfolds) if j != k])
        best = max(thresholds, key=lambda t: np.mean((dist_[train] < t) == issame[train]))
        accs.append(np.mean((dist_[test] < best) == issame[test]))
    backbone.train()
    return float(np.mean(accs))


def main():
    args = get_args()
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    dist.init_process_group(backend="nccl")
    local_rank = args.local_rank
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(message)s")
    os.makedirs(args.output, exist_ok=True)
    writer = SummaryWriter(os.path.join(args.output, "tb")) if rank == 0 else None

    train_set = MXFaceDataset(args.rec)
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler,
                        num_workers=args.num_workers, pin_memory=True, drop_last=True)

    model = FaceModel(args).to(device)
    start_epoch = 0
    ckpt_path = os.path.join(args.output, "checkpoint.pt")
    if args.resume and os.path.exists(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location="cpu")
        model.load_state_dict(ckpt["model"])
        start_epoch = ckpt["epoch"] + 1
    model = DDP(model, device_ids=[local_rank], broadcast_buffers=False)

    lr = args.lr * args.batch_size * world_size / 512
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=args.momentum,
                                weight_decay=args.weight_decay)
    steps_per_epoch = len(loader)
    milestones = [e * steps_per_epoch for e in args.decay_epochs]
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones, gamma=0.1,
                                                     last_epoch=-1)
    for _ in range(start_epoch * steps_per_epoch):
        scheduler.step()
    scaler = torch.cuda.amp.GradScaler(enabled=args.fp16)
    criterion = nn.CrossEntropyLoss()

    val_sets = {}
    if rank == 0:
        for name in args.val_targets:
            path = os.path.join(args.rec, name + ".bin")
            if os.path.exists(path):
                val_sets[name] = load_bin(path)

    global_step = start_epoch * steps_per_epoch
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        for step, (images, labels) in enumerate(loader):
            images = images.to(device, non_blocking=True)
            labels = labels.to(device, non_blocking=True)
            logits = model(images, labels)
            loss = criterion(logits, labels)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), max_norm=5.0)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            global_step += 1
            if rank == 0 and step % args.log_interval == 0:
                speed = args.log_interval * args.batch_size * world_size / (time.time() - tic)
                tic = time.time()
                logging.info("epoch %d step %d/%d loss %.4f lr %.5f %.0f img/s", epoch, step,
                             steps_per_epoch, loss.item(), scheduler.get_last_lr()[0], speed)
                writer.add_scalar("train/loss", loss.item(), global_step)

        if rank == 0:
            for name, (data, issame) in val_sets.items():
                acc = verification(model.module.backbone, data, issame, device)
                logging.info("[%s] epoch %d accuracy %.5f", name, epoch, acc)
                writer.add_scalar(f"val/{name}", acc, epoch)
            torch.save({"model": model.module.state_dict(), "epoch": epoch}, ckpt_path)
            torch.save(model.module.backbone.state_dict(),
                       os.path.join(args.output, "backbone.pth"))
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
