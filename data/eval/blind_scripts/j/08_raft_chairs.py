"""Small RAFT-style optical flow training on FlyingChairs.

torchrun --standalone --nproc_per_node=4 08_raft_chairs.py --name raft-chairs --num_steps 100000
"""
from __future__ import print_function, division
import os
import glob
import time
import argparse
import random

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist
from torch.utils.data import Dataset, DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.nn.parallel import DistributedDataParallel as DDP
from PIL import Image

DEVICE = 'cuda:0'
MAX_FLOW = 400
SUM_FREQ = 100
VAL_FREQ = 5000


# ----------------------------------------------------------------------------- utils
def read_flo(fn):
    with open(fn, 'rb') as f:
        magic = np.fromfile(f, np.float32, count=1)
        assert magic == 202021.25, 'bad .flo'
        w = int(np.fromfile(f, np.int32, count=1)[0])
        h = int(np.fromfile(f, np.int32, count=1)[0])
        data = np.fromfile(f, np.float32, count=2 * w * h)
    return np.resize(data, (h, w, 2))


def to_device(blob):
    return [x.to(DEVICE, non_blocking=True) for x in blob]


def sequence_loss(flow_preds, flow_gt, valid, gamma=0.8):
    n = len(flow_preds)
    mag = torch.sum(flow_gt ** 2, dim=1).sqrt()
    valid = (valid >= 0.5) & (mag < MAX_FLOW)
    loss = 0.0
    for i in range(n):
        w = gamma ** (n - i - 1)
        loss = loss + w * (valid[:, None] * (flow_preds[i] - flow_gt).abs()).mean()
    epe = torch.sum((flow_preds[-1] - flow_gt) ** 2, dim=1).sqrt().view(-1)[valid.view(-1)]
    return loss, torch.stack([epe.mean(), (epe < 1).float().mean(), (epe < 3).float().mean()])


# ----------------------------------------------------------------------------- data
class FlyingChairs(Dataset):
    def __init__(self, root, split='training', crop=(368, 496)):
        imgs = sorted(glob.glob(os.path.join(root, '*.ppm')))
        flows = sorted(glob.glob(os.path.join(root, '*.flo')))
        split_list = np.loadtxt('chairs_split.txt', dtype=np.int32)
        want = 1 if split == 'training' else 2
        self.items = [(imgs[2 * i], imgs[2 * i + 1], flows[i]) for i in range(len(flows)) if split_list[i] == want]
        self.crop = crop
        self.train = split == 'training'

    def __len__(self):
        return len(self.items)

    def __getitem__(self, idx):
        a, b, f = self.items[idx]
        img1 = np.array(Image.open(a)).astype(np.float32)
        img2 = np.array(Image.open(b)).astype(np.float32)
        flow = read_flo(f).astype(np.float32)
        if self.train:
            ch, cw = self.crop
            y0 = random.randint(0, img1.shape[0] - ch)
            x0 = random.randint(0, img1.shape[1] - cw)
            img1, img2 = img1[y0:y0 + ch, x0:x0 + cw], img2[y0:y0 + ch, x0:x0 + cw]
            flow = flow[y0:y0 + ch, x0:x0 + cw]
            if random.random() < 0.5:
                img1, img2 = img1[:, ::-1], img2[:, ::-1]
                flow = flow[:, ::-1] * [-1.0, 1.0]
        t = lambda x: torch.from_numpy(np.ascontiguousarray(x)).permute(2, 0, 1).float()
        flow_t = t(flow)
        valid = ((flow_t[0].abs() < 1000) & (flow_t[1].abs() < 1000)).float()
        return t(img1), t(img2), flow_t, valid


# ----------------------------------------------------------------------------- model
def conv(i, o, s=1):
    return nn.Sequential(nn.Conv2d(i, o, 3, s, 1), nn.InstanceNorm2d(o), nn.ReLU(inplace=True))


class Encoder(nn.Module):
    def __init__(self, out=128):
        super().__init__()
        self.net = nn.Sequential(conv(3, 64, 2), conv(64, 96, 2), conv(96, 128, 2), nn.Conv2d(128, out, 1))

    def forward(self, x):
        return self.net(x)


class UpdateBlock(nn.Module):
    def __init__(self, hdim=96, cdim=81):
        super().__init__()
        self.enc = nn.Sequential(nn.Conv2d(cdim + 2, 128, 3, padding=1), nn.ReLU(inplace=True))
        self.gru_z = nn.Conv2d(hdim + 128 + 64, hdim, 3, padding=1)
        self.gru_r = nn.Conv2d(hdim + 128 + 64, hdim, 3, padding=1)
        self.gru_q = nn.Conv2d(hdim + 128 + 64, hdim, 3, padding=1)
        self.flow_head = nn.Sequential(nn.Conv2d(hdim, 128, 3, padding=1), nn.ReLU(inplace=True),
                                       nn.Conv2d(128, 2, 3, padding=1))

    def forward(self, net, inp, corr, flow):
        x = torch.cat([inp, self.enc(torch.cat([corr, flow], 1))], 1)
        hx = torch.cat([net, x], 1)
        z, r = torch.sigmoid(self.gru_z(hx)), torch.sigmoid(self.gru_r(hx))
        q = torch.tanh(self.gru_q(torch.cat([r * net, x], 1)))
        net = (1 - z) * net + z * q
        return net, self.flow_head(net)


class SmallRAFT(nn.Module):
    def __init__(self, radius=4):
        super().__init__()
        self.radius = radius
        self.fnet = Encoder(128)
        self.cnet = Encoder(96 + 64)
        self.update = UpdateBlock(96, (2 * radius + 1) ** 2)

    def local_corr(self, f1, f2, flow):
        B, C, H, W = f1.shape
        ys, xs = torch.meshgrid(torch.arange(H, device=f1.device), torch.arange(W, device=f1.device), indexing='ij')
        base = torch.stack([xs, ys], 0).float()[None] + flow
        out = []
        r = self.radius
        for dy in range(-r, r + 1):
            for dx in range(-r, r + 1):
                g = base + torch.tensor([dx, dy], device=f1.device, dtype=torch.float32).view(1, 2, 1, 1)
                gx = 2 * g[:, 0] / (W - 1) - 1
                gy = 2 * g[:, 1] / (H - 1) - 1
                w = F.grid_sample(f2, torch.stack([gx, gy], -1), align_corners=True)
                out.append((f1 * w).sum(1, keepdim=True) / C ** 0.5)
        return torch.cat(out, 1)

    def forward(self, img1, img2, iters=8):
        img1, img2 = 2 * (img1 / 255.0) - 1, 2 * (img2 / 255.0) - 1
        f1, f2 = self.fnet(img1), self.fnet(img2)
        net, inp = torch.split(self.cnet(img1), [96, 64], 1)
        net, inp = torch.tanh(net), torch.relu(inp)
        flow = torch.zeros(f1.size(0), 2, f1.size(2), f1.size(3), device=f1.device)
        preds = []
        for _ in range(iters):
            flow = flow.detach()
            corr = self.local_corr(f1, f2, flow)
            net, delta = self.update(net, inp, corr, flow)
            flow = flow + delta
            preds.append(8 * F.interpolate(flow, scale_factor=8, mode='bilinear', align_corners=True))
        return preds


# ----------------------------------------------------------------------------- train
def train(args):
    local_rank = int(os.environ['LOCAL_RANK'])
    torch.cuda.set_device(local_rank)
    dist.init_process_group('nccl')
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1234)
    np.random.seed(1234 + rank)

    model = SmallRAFT().cuda()
    model = DDP(model, device_ids=[local_rank])
    if args.restore_ckpt is not None:
        model.module.load_state_dict(torch.load(args.restore_ckpt, map_location='cuda:%d' % local_rank))

    train_ds = FlyingChairs(args.root, 'training', tuple(args.image_size))
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, pin_memory=True,
                        num_workers=4, drop_last=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.wdecay, eps=1e-8)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, args.lr, args.num_steps + 100,
                                                    pct_start=0.05, cycle_momentum=False, anneal_strategy='linear')
    scaler = torch.cuda.amp.GradScaler(enabled=args.mixed_precision)

    total_steps, epoch = 0, 0
    running = torch.zeros(4, device='cuda')
    os.makedirs('checkpoints', exist_ok=True)
    while total_steps < args.num_steps:
        sampler.set_epoch(epoch)
        model.train()
        for blob in loader:
            image1, image2, flow, valid = to_device(blob)
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast('cuda', enabled=args.mixed_precision):
                flow_preds = model(image1, image2, iters=args.iters)
            loss, metrics = sequence_loss([p.float() for p in flow_preds], flow, valid, args.gamma)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            scaler.step(optimizer)
            scheduler.step()
            scaler.update()
            running += torch.cat([loss.detach()[None], metrics.detach()])
            total_steps += 1

            if total_steps % SUM_FREQ == 0:
                dist.all_reduce(running)
                running /= (SUM_FREQ * world)
                if rank == 0:
                    print('[%6d, %10.7f] loss %.4f epe %.4f 1px %.3f 3px %.3f' % (
                        total_steps, scheduler.get_last_lr()[0], *running.tolist()), flush=True)
                running.zero_()
            if total_steps % VAL_FREQ == 0 and rank == 0:
                torch.save(model.module.state_dict(), 'checkpoints/%d_%s.pth' % (total_steps, args.name))
            if total_steps >= args.num_steps:
                break
        epoch += 1

    if rank == 0:
        torch.save(model.module.state_dict(), 'checkpoints/%s.pth' % args.name)
    dist.destroy_process_group()


if __name__ == '__main__':
    parser = argparse.ArgumentParser()
    parser.add_argument('--name', default='raft', help='name your experiment')
    parser.add_argument('--root', default='datasets/FlyingChairs_release/data')
    parser.add_argument('--restore_ckpt', help='restore checkpoint')
    parser.add_argument('--lr', type=float, default=0.0004)
    parser.add_argument('--num_steps', type=int, default=100000)
    parser.add_argument('--batch_size', type=int, default=3)
    parser.add_argument('--image_size', type=int, nargs='+', default=[368, 496])
    parser.add_argument('--iters', type=int, default=8)
    parser.add_argument('--wdecay', type=float, default=.0001)
    parser.add_argument('--clip', type=float, default=1.0)
    parser.add_argument('--gamma', type=float, default=0.8)
    parser.add_argument('--mixed_precision', action='store_true')
    args = parser.parse_args()
    train(args)
