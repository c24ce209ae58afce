"""CenterNet (objects as points) with a ResNet-18 + deconv head on PASCAL VOC 07+12.

    python -m torch.distributed.run --nproc_per_node 4 14_centernet_voc.py --voc /data/VOCdevkit --epochs 70

mAP is computed offline with tools/eval_voc.py on the saved checkpoints; here we only
track the validation loss.
"""
import argparse
import math
import os
import time
import xml.etree.ElementTree as ET

import cv2
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.utils.data import DataLoader, Dataset
from torch.utils.tensorboard import SummaryWriter

VOC_CLASSES = ('aeroplane', 'bicycle', 'bird', 'boat', 'bottle', 'bus', 'car', 'cat', 'chair', 'cow',
               'diningtable', 'dog', 'horse', 'motorbike', 'person', 'pottedplant', 'sheep', 'sofa',
               'train', 'tvmonitor')
INPUT, STRIDE, MAX_OBJS = 384, 4, 64
MEAN = np.array([0.408, 0.447, 0.470], np.float32)
STD = np.array([0.289, 0.274, 0.278], np.float32)


def gaussian_radius(h, w, min_overlap=0.7):
    a1, b1, c1 = 1, h + w, w * h * (1 - min_overlap) / (1 + min_overlap)
    r1 = (b1 + math.sqrt(b1 ** 2 - 4 * a1 * c1)) / 2
    a2, b2, c2 = 4, 2 * (h + w), (1 - min_overlap) * w * h
    r2 = (b2 + math.sqrt(b2 ** 2 - 4 * a2 * c2)) / 2
    a3, b3, c3 = 4 * min_overlap, -2 * min_overlap * (h + w), (min_overlap - 1) * w * h
    r3 = (b3 + math.sqrt(b3 ** 2 - 4 * a3 * c3)) / 2
    return min(r1, r2, r3)


def draw_gaussian(hm, cx, cy, r):
    d = 2 * r + 1
    ys, xs = np.ogrid[-r:r + 1, -r:r + 1]
    g = np.exp(-(xs * xs + ys * ys) / (2 * (d / 6) ** 2))
    H, W = hm.shape
    l, rr = min(cx, r), min(W - cx, r + 1)
    t, b = min(cy, r), min(H - cy, r + 1)
    np.maximum(hm[cy - t:cy + b, cx - l:cx + rr], g[r - t:r + b, r - l:r + rr], out=hm[cy - t:cy + b, cx - l:cx + rr])


class VOCCenter(Dataset):
    def __init__(self, root, sets, train=True):
        self.ids = []
        for year, split in sets:
            base = os.path.join(root, f'VOC{year}')
            with open(os.path.join(base, 'ImageSets/Main', split + '.txt')) as f:
                self.ids += [(base, l.strip()) for l in f if l.strip()]
        self.train = train

    def __len__(self):
        return len(self.ids)

    def _ann(self, base, i):
        boxes, labels = [], []
        for obj in ET.parse(os.path.join(base, 'Annotations', i + '.xml')).findall('object'):
            if int(obj.find('difficult').text):
                continue
            bb = obj.find('bndbox')
            boxes.append([float(bb.find(k).text) - 1 for k in ('xmin', 'ymin', 'xmax', 'ymax')])
            labels.append(VOC_CLASSES.index(obj.find('name').text.strip()))
        return np.array(boxes, np.float32).reshape(-1, 4), np.array(labels, np.int64)

    def __getitem__(self, idx):
        base, i = self.ids[idx]
        img = cv2.imread(os.path.join(base, 'JPEGImages', i + '.jpg'))[:, :, ::-1]
        boxes, labels = self._ann(base, i)
        h, w = img.shape[:2]
        if self.train and np.random.rand() < 0.5:
            img = img[:, ::-1]
            boxes[:, [0, 2]] = w - 1 - boxes[:, [2, 0]]
        img = cv2.resize(np.ascontiguousarray(img), (INPUT, INPUT))
        boxes *= np.array([INPUT / w, INPUT / h] * 2, np.float32)
        img = ((img.astype(np.float32) / 255. - MEAN) / STD).transpose(2, 0, 1)

        O = INPUT // STRIDE
        hm = np.zeros((len(VOC_CLASSES), O, O), np.float32)
        wh = np.zeros((MAX_OBJS, 2), np.float32)
        reg = np.zeros((MAX_OBJS, 2), np.float32)
        ind = np.zeros(MAX_OBJS, np.int64)
        mask = np.zeros(MAX_OBJS, np.float32)
        for k, (b, c) in enumerate(zip(boxes[:MAX_OBJS] / STRIDE, labels[:MAX_OBJS])):
            bw, bh = b[2] - b[0], b[3] - b[1]
            if bw <= 0 or bh <= 0:
                continue
            ct = np.array([(b[0] + b[2]) / 2, (b[1] + b[3]) / 2], np.float32)
            ci = np.clip(ct.astype(np.int32), 0, O - 1)
            draw_gaussian(hm[c], ci[0], ci[1], max(0, int(gaussian_radius(math.ceil(bh), math.ceil(bw)))))
            wh[k], reg[k], ind[k], mask[k] = (bw, bh), ct - ci, ci[1] * O + ci[0], 1
        return torch.from_numpy(img), {'hm': hm, 'wh': wh, 'reg': reg, 'ind': ind, 'mask': mask}


class CenterNet(nn.Module):
    def __init__(self, num_classes=20, head_conv=64):
        super().__init__()
        r = torchvision.models.resnet18(weights='IMAGENET1K_V1')
        self.backbone = nn.Sequential(*list(r.children())[:-2])
        layers, cin = [], 512
        for cout in (256, 128, 64):
            layers += [nn.ConvTranspose2d(cin, cout, 4, 2, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True)]
            cin = cout
        self.deconv = nn.Sequential(*layers)

        def head(out):
            return nn.Sequential(nn.Conv2d(64, head_conv, 3, padding=1), nn.ReLU(inplace=True), nn.Conv2d(head_conv, out, 1))
        self.hm, self.wh, self.reg = head(num_classes), head(2), head(2)
        self.hm[-1].bias.data.fill_(-2.19)

    def forward(self, x):
        f = self.deconv(self.backbone(x))
        return self.hm(f), self.wh(f), self.reg(f)


def focal_loss(pred, gt):
    pred = pred.sigmoid().clamp(1e-4, 1 - 1e-4)
    pos = gt.eq(1).float()
    neg_w = torch.pow(1 - gt, 4)
    pos_loss = (torch.log(pred) * torch.pow(1 - pred, 2) * pos).sum()
    neg_loss = (torch.log(1 - pred) * torch.pow(pred, 2) * neg_w * (1 - pos)).sum()
    return -(pos_loss + neg_loss) / pos.sum().clamp(min=1)


def reg_l1(out, ind, mask, target):
    B, C = out.shape[:2]
    feat = out.view(B, C, -1).permute(0, 2, 1).gather(1, ind[..., None].expand(-1, -1, C))
    m = mask[..., None]
    return F.l1_loss(feat * m, target * m, reduction='sum') / (m.sum() * C + 1e-4)


def compute_loss(outputs, t):
    hm, wh, reg = outputs
    l_hm = focal_loss(hm, t['hm'])
    l_wh = reg_l1(wh, t['ind'], t['mask'], t['wh'])
    l_off = reg_l1(reg, t['ind'], t['mask'], t['reg'])
    return l_hm + 0.1 * l_wh + l_off, (l_hm, l_wh, l_off)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--voc', default='/data/VOCdevkit')
    ap.add_argument('--batch-size', type=int, default=32, help='per GPU')
    ap.add_argument('--epochs', type=int, default=70)
    ap.add_argument('--lr', type=float, default=1.25e-4, help='for batch 32 on one GPU')
    ap.add_argument('--workers', type=int, default=6)
    ap.add_argument('--save-dir', default='exp/centernet_r18_voc')
    args = ap.parse_args()

    local_rank = int(os.environ['LOCAL_RANK'])
    torch.cuda.set_device(local_rank)
    dist.init_process_group('nccl')
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device('cuda', local_rank)

    train_set = VOCCenter(args.voc, [('2007', 'trainval'), ('2012', 'trainval')], train=True)
    val_set = VOCCenter(args.voc, [('2007', 'test')], train=False)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True, num_workers=args.workers,
                              pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=args.batch_size, shuffle=False, num_workers=args.workers)

    model = CenterNet(len(VOC_CLASSES))
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = nn.parallel.DistributedDataParallel(model, device_ids=[local_rank])
    lr = args.lr * world  # linear scaling with the number of GPUs
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[45, 60], gamma=0.1)

    writer = SummaryWriter(os.path.join(args.save_dir, 'logs')) if rank == 0 else None
    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)

    best_val = float('inf')
    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        for it, (img, tgt) in enumerate(train_loader):
            img = img.to(device, non_blocking=True)
            tgt = {k: v.to(device, non_blocking=True) for k, v in tgt.items()}
            loss, (l_hm, l_wh, l_off) = compute_loss(model(img), tgt)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if rank == 0 and it % 50 == 0:
                print(f'[{epoch}/{args.epochs}][{it}/{len(train_loader)}] loss {loss.item():.3f} '
                      f'hm {l_hm.item():.3f} wh {l_wh.item():.3f} off {l_off.item():.3f}')
                writer.add_scalar('train/loss', loss.item(), epoch * len(train_loader) + it)
        scheduler.step()

        if rank == 0:
            net = model.module
            net.eval()
            tot, n = 0., 0
            with torch.no_grad():
                for img, tgt in val_loader:
                    tgt = {k: v.to(device) for k, v in tgt.items()}
                    tot += compute_loss(net(img.to(device)), tgt)[0].item() * img.size(0)
                    n += img.size(0)
            val_loss = tot / n
            print(f'epoch {epoch} val loss {val_loss:.4f} ({time.time() - t0:.0f}s)')
            writer.add_scalar('val/loss', val_loss, epoch)
            ckpt = {'epoch': epoch, 'model': net.state_dict(), 'optimizer': optimizer.state_dict()}
            torch.save(ckpt, os.path.join(args.save_dir, 'model_last.pth'))
            if val_loss < best_val:
                best_val = val_loss
                torch.save(ckpt, os.path.join(args.save_dir, 'model_best.pth'))
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == '__main__':
    main()
