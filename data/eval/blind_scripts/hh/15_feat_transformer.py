#!/usr/bin/env python3
"""FEAT (Ye et al. 2020): few-shot embedding adaptation with a set-to-set Transformer.

The prototypes of an episode are adapted jointly by one multi-head self-attention
layer before nearest-prototype classification; a contrastive regulariser on the
adapted query embeddings is added during training. Backbone is initialised from a
pre-trained ResNet-12.

    torchrun --nproc_per_node=4 15_feat_transformer.py --data-root /data/miniImageNet \
        --init-weights pretrained/res12_mini.pth --shot 1 --balance 0.1 --temperature 64 --temperature2 32
"""
import argparse
import os
import os.path as osp
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torchvision import transforms


def get_parser():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data-root", type=str, default="/data/miniImageNet")
    parser.add_argument("--init-weights", type=str, default=None)
    parser.add_argument("--save-dir", type=str, default="./checkpoints/feat")
    parser.add_argument("--way", type=int, default=5)
    parser.add_argument("--eval-way", type=int, default=5)
    parser.add_argument("--shot", type=int, default=1)
    parser.add_argument("--query", type=int, default=15)
    parser.add_argument("--max-epoch", type=int, default=200)
    parser.add_argument("--episodes-per-epoch", type=int, default=100)
    parser.add_argument("--num-eval-episodes", type=int, default=600)
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--lr-mul", type=float, default=10.0, help="lr multiplier for the attention module")
    parser.add_argument("--step-size", type=int, default=40)
    parser.add_argument("--gamma", type=float, default=0.5)
    parser.add_argument("--balance", type=float, default=0.1)
    parser.add_argument("--temperature", type=float, default=64.0)
    parser.add_argument("--temperature2", type=float, default=32.0)
    parser.add_argument("--num-workers", type=int, default=8)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--local_rank", type=int, default=0)
    return parser


class MiniImageNet(Dataset):
    def __init__(self, root, setname, augment=False):
        csv_path = osp.join(root, "split", setname + ".csv")
        lines = [x.strip() for x in open(csv_path).readlines()][1:]
        self.data, self.label, self.wnids = [], [], []
        for l in lines:
            name, wnid = l.split(",")
            if wnid not in self.wnids:
                self.wnids.append(wnid)
            self.data.append(osp.join(root, "images", name))
            self.label.append(len(self.wnids) - 1)
        self.num_class = len(self.wnids)
        norm = transforms.Normalize(np.array([x / 255.0 for x in [120.39586422, 115.59361427, 104.54012653]]),
                                    np.array([x / 255.0 for x in [70.68188272, 68.27635443, 72.54505529]]))
        if augment:
            self.transform = transforms.Compose([transforms.RandomResizedCrop(84), transforms.RandomHorizontalFlip(),
                                                 transforms.ColorJitter(0.4, 0.4, 0.4), transforms.ToTensor(), norm])
        else:
            self.transform = transforms.Compose([transforms.Resize(92), transforms.CenterCrop(84),
                                                 transforms.ToTensor(), norm])

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return self.transform(Image.open(self.data[i]).convert("RGB")), self.label[i]


class CategoriesSampler:
    def __init__(self, label, n_batch, n_cls, n_per, seed):
        label = np.array(label)
        self.m_ind = [torch.from_numpy(np.argwhere(label == i).reshape(-1)) for i in range(max(label) + 1)]
        self.n_batch, self.n_cls, self.n_per = n_batch, n_cls, n_per
        self.g = torch.Generator()
        self.g.manual_seed(seed)

    def __len__(self):
        return self.n_batch

    def __iter__(self):
        for _ in range(self.n_batch):
            classes = torch.randperm(len(self.m_ind), generator=self.g)[: self.n_cls]
            batch = [self.m_ind[c][torch.randperm(len(self.m_ind[c]), generator=self.g)[: self.n_per]]
                     for c in classes]
            yield torch.stack(batch).t().reshape(-1)


def conv3x3(i, o):
    return nn.Conv2d(i, o, kernel_size=3, stride=1, padding=1, bias=False)


class BasicBlock(nn.Module):
    def __init__(self, inplanes, planes):
        super().__init__()
        self.conv1, self.bn1 = conv3x3(inplanes, planes), nn.BatchNorm2d(planes)
        self.conv2, self.bn2 = conv3x3(planes, planes), nn.BatchNorm2d(planes)
        self.conv3, self.bn3 = conv3x3(planes, planes), nn.BatchNorm2d(planes)
        self.relu = nn.LeakyReLU(0.1)
        self.downsample = nn.Sequential(nn.Conv2d(inplanes, planes, 1, bias=False), nn.BatchNorm2d(planes))
        self.maxpool = nn.MaxPool2d(2)

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.maxpool(self.relu(out + self.downsample(x)))


class ResNet12(nn.Module):
    def __init__(self, channels=(64, 160, 320, 640)):
        super().__init__()
        self.layer1 = BasicBlock(3, channels[0])
        self.layer2 = BasicBlock(channels[0], channels[1])
        self.layer3 = BasicBlock(channels[1], channels[2])
        self.layer4 = BasicBlock(channels[2], channels[3])

    def forward(self, x):
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return F.adaptive_avg_pool2d(x, 1).flatten(1)


class FEAT(nn.Module):
    def __init__(self, args, hdim=640):
        super().__init__()
        self.args = args
        self.encoder = ResNet12()
        self.slf_attn = nn.MultiheadAttention(hdim, num_heads=1, dropout=0.5, batch_first=True)
        self.ln = nn.LayerNorm(hdim)

    def adapt(self, x):
        out, _ = self.slf_attn(x, x, x)
        return self.ln(x + out)

    def forward(self, data, way, shot, query):
        emb = self.encoder(data)
        d = emb.size(-1)
        support = emb[: way * shot].view(shot, way, d)
        qry = emb[way * shot:]
        proto = self.adapt(support.mean(0).unsqueeze(0)).squeeze(0)
        logits = -torch.cdist(qry, proto).pow(2) / self.args.temperature
        if not self.training:
            return logits, None
        # contrastive regulariser: adapt each class's support+query set and use its centre
        aux = torch.cat([support, qry.view(query, way, d)], 0).permute(1, 0, 2)  # [way, shot+query, d]
        aux = self.adapt(aux)
        aux_center = aux.mean(1)
        aux_logits = -torch.cdist(aux.reshape(-1, d), aux_center).pow(2) / self.args.temperature2
        return logits, aux_logits


def main():
    args = get_parser().parse_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", args.local_rank)
    torch.manual_seed(args.seed)

    trainset = MiniImageNet(args.data_root, "train", augment=True)
    valset = MiniImageNet(args.data_root, "val")
    train_loader = DataLoader(trainset, num_workers=args.num_workers, pin_memory=True,
                              batch_sampler=CategoriesSampler(trainset.label, args.episodes_per_epoch, args.way,
                                                              args.shot + args.query, seed=args.seed * 97 + rank))
    val_loader = DataLoader(valset, num_workers=args.num_workers, pin_memory=True,
                            batch_sampler=CategoriesSampler(valset.label, args.num_eval_episodes // world,
                                                            args.eval_way, args.shot + args.query, seed=3 + rank))

    model = FEAT(args)
    if args.init_weights:
        pretrained = torch.load(args.init_weights, map_location="cpu")["params"]
        pretrained = {k.replace("encoder.", "", 1): v for k, v in pretrained.items() if k.startswith("encoder.")}
        model.encoder.load_state_dict(pretrained)
    model = DDP(model.to(device), device_ids=[args.local_rank])
    optimizer = torch.optim.Adam([
        {"params": model.module.encoder.parameters()},
        {"params": list(model.module.slf_attn.parameters()) + list(model.module.ln.parameters()),
         "lr": args.lr * args.lr_mul},
    ], lr=args.lr)
    lr_scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=args.step_size, gamma=args.gamma)

    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)
    label = torch.arange(args.way, device=device).repeat(args.query)
    label_aux = torch.arange(args.way, device=device).repeat_interleave(args.shot + args.query)
    eval_label = torch.arange(args.eval_way, device=device).repeat(args.query)
    max_acc = 0.0

    for epoch in range(1, args.max_epoch + 1):
        model.train()
        tic = time.time()
        tl = torch.zeros(3, device=device)
        for data, _ in train_loader:
            data = data.to(device, non_blocking=True)
            logits, aux_logits = model(data, args.way, args.shot, args.query)
            loss = F.cross_entropy(logits, label) + args.balance * F.cross_entropy(aux_logits, label_aux)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            tl += torch.stack([loss.detach(), (logits.argmax(1) == label).float().mean(), torch.ones_like(loss)])
        lr_scheduler.step()

        model.eval()
        va = torch.zeros(2, device=device)
        with torch.no_grad():
            for data, _ in val_loader:
                logits, _ = model(data.to(device, non_blocking=True), args.eval_way, args.shot, args.query)
                va += torch.stack([(logits.argmax(1) == eval_label).float().mean(), torch.ones((), device=device)])
        dist.all_reduce(tl)
        dist.all_reduce(va)
        acc = (va[0] / va[1]).item()
        if rank == 0:
            print(f"epoch {epoch}: loss {(tl[0] / tl[2]).item():.4f} train acc {(tl[1] / tl[2]).item():.4f} "
                  f"val acc {acc:.4f} ({time.time() - tic:.0f}s)", flush=True)
            if acc > max_acc:
                max_acc = acc
                torch.save({"params": model.module.state_dict(), "epoch": epoch},
                           osp.join(args.save_dir, "max_acc.pth"))
            torch.save({"params": model.module.state_dict(), "epoch": epoch}, osp.join(args.save_dir, "epoch-last.pth"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
