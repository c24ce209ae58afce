"""DeepLabV3+ training on Cityscapes (fine annotations).

torchrun --nproc_per_node=8 01_semseg_deeplab.py --data_root /data/cityscapes --batch_size 2
"""
import os
import time
import argparse
import random

import numpy as np
from PIL import Image
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist
from torch.utils.data import Dataset, DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.nn.parallel import DistributedDataParallel as DDP
import torchvision
from torchvision.models.segmentation import deeplabv3_resnet101

parser = argparse.ArgumentParser()
parser.add_argument('--data_root', type=str, default='/data/cityscapes')
parser.add_argument('--num_classes', type=int, default=19)
parser.add_argument('--batch_size', type=int, default=2, help='per gpu')
parser.add_argument('--crop_size', type=int, default=768)
parser.add_argument('--lr', type=float, default=0.01)
parser.add_argument('--weight_decay', type=float, default=1e-4)
parser.add_argument('--total_itrs', type=int, default=30000)
parser.add_argument('--val_interval', type=int, default=1000)
parser.add_argument('--workers', type=int, default=4)
parser.add_argument('--output_stride', type=int, default=16)
parser.add_argument('--ckpt', type=str, default=None)
parser.add_argument('--save_dir', type=str, default='checkpoints/deeplab')
parser.add_argument('--seed', type=int, default=1)
args = parser.parse_args()

IGNORE = 255
MEAN = np.array([0.485, 0.456, 0.406])
STD = np.array([0.229, 0.224, 0.225])

# ---------------------------------------------------------------- utils
def is_main():
    return dist.get_rank() == 0


def log(*a):
    if is_main():
        print(time.strftime('[%H:%M:%S]'), *a, flush=True)


def poly_lr(optimizer, base_lr, itr, max_itr, power=0.9):
    lr = base_lr * (1 - itr / max_itr) ** power
    for i, g in enumerate(optimizer.param_groups):
        g['lr'] = lr * (10 if i == 1 else 1)
    return lr


class StreamSegMetrics:
    def __init__(self, n):
        self.n = n
        self.hist = torch.zeros(n, n, dtype=torch.float64, device='cuda')

    def update(self, pred, gt):
        mask = gt != IGNORE
        idx = gt[mask] * self.n + pred[mask]
        self.hist += torch.bincount(idx, minlength=self.n ** 2).reshape(self.n, self.n).double()

    def reduce(self):
        dist.all_reduce(self.hist)

    def miou(self):
        h = self.hist
        iu = torch.diag(h) / (h.sum(1) + h.sum(0) - torch.diag(h) + 1e-10)
        return iu.mean().item()


# ---------------------------------------------------------------- data
class Cityscapes(Dataset):
    def __init__(self, root, split='train', crop=768):
        self.split = split
        self.crop = crop
        img_dir = os.path.join(root, 'leftImg8bit', split)
        self.images, self.targets = [], []
        for city in sorted(os.listdir(img_dir)):
            for f in sorted(os.listdir(os.path.join(img_dir, city))):
                self.images.append(os.path.join(img_dir, city, f))
                t = f.replace('leftImg8bit', 'gtFine_labelTrainIds')
                self.targets.append(os.path.join(root, 'gtFine', split, city, t))

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        img = Image.open(self.images[i]).convert('RGB')
        tgt = Image.open(self.targets[i])
        if self.split == 'train':
            s = random.uniform(0.5, 2.0)
            w, h = img.size
            nw, nh = int(w * s), int(h * s)
            img = img.resize((nw, nh), Image.BILINEAR)
            tgt = tgt.resize((nw, nh), Image.NEAREST)
            x = random.randint(0, max(0, nw - self.crop))
            y = random.randint(0, max(0, nh - self.crop))
            img = img.crop((x, y, x + self.crop, y + self.crop))
            tgt = tgt.crop((x, y, x + self.crop, y + self.crop))
            if random.random() < 0.5:
                img = img.transpose(Image.FLIP_LEFT_RIGHT)
                tgt = tgt.transpose(Image.FLIP_LEFT_RIGHT)
        img = (np.asarray(img, dtype=np.float32) / 255. - MEAN) / STD
        img = torch.from_numpy(img.transpose(2, 0, 1)).float()
        tgt = torch.from_numpy(np.array(tgt, dtype=np.int64))
        return img, tgt


# ---------------------------------------------------------------- main
def main():
    local_rank = int(os.environ['LOCAL_RANK'])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend='nccl')
    world = dist.get_world_size()
    torch.manual_seed(args.seed + dist.get_rank())
    np.random.seed(args.seed + dist.get_rank())
    random.seed(args.seed + dist.get_rank())

    train_set = Cityscapes(args.data_root, 'train', args.crop_size)
    val_set = Cityscapes(args.data_root, 'val')
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    # shard val without padding so every image is counted exactly once
    val_shard = torch.utils.data.Subset(val_set, list(range(dist.get_rank(), len(val_set), world)))
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_shard, batch_size=1, shuffle=False, num_workers=2)
    log('train %d val %d world %d' % (len(train_set), len(val_set), world))

    model = deeplabv3_resnet101(weights=None, weights_backbone='IMAGENET1K_V1',
                                num_classes=args.num_classes, aux_loss=False)
    model = model.cuda()
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    optimizer = torch.optim.SGD([
        {'params': model.module.backbone.parameters(), 'lr': args.lr},
        {'params': model.module.classifier.parameters(), 'lr': args.lr * 10},
    ], lr=args.lr, momentum=0.9, weight_decay=args.weight_decay)
    criterion = nn.CrossEntropyLoss(ignore_index=IGNORE)

    cur_itr, best_miou = 0, 0.0
    if args.ckpt is not None and os.path.isfile(args.ckpt):
        ck = torch.load(args.ckpt, map_location='cuda:%d' % local_rank)
        model.module.load_state_dict(ck['model_state'])
        optimizer.load_state_dict(ck['optimizer_state'])
        cur_itr, best_miou = ck['cur_itrs'], ck['best_score']
        log('resumed from', args.ckpt, 'itr', cur_itr)

    os.makedirs(args.save_dir, exist_ok=True)
    epoch = 0
    while cur_itr < args.total_itrs:
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for images, labels in train_loader:
            images = images.cuda(non_blocking=True)
            labels = labels.cuda(non_blocking=True)
            out = model(images)['out']
            loss = criterion(out, labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            lr = poly_lr(optimizer, args.lr, cur_itr, args.total_itrs)
            cur_itr += 1

            if cur_itr % 10 == 0:
                l = loss.detach().clone()
                dist.all_reduce(l)
                log('itr %d/%d loss %.4f lr %.5f %.2fs/it' % (cur_itr, args.total_itrs, l.item() / world,
                                                             lr, (time.time() - t0) / 10))
                t0 = time.time()

            if cur_itr % args.val_interval == 0:
                miou = validate(model, val_loader)
                log('itr %d  mIoU %.4f' % (cur_itr, miou))
                if is_main():
                    state = {'cur_itrs': cur_itr, 'model_state': model.module.state_dict(),
                             'optimizer_state': optimizer.state_dict(), 'best_score': max(miou, best_miou)}
                    torch.save(state, os.path.join(args.save_dir, 'latest.pth'))
                    if miou > best_miou:
                        torch.save(state, os.path.join(args.save_dir, 'best.pth'))
                best_miou = max(miou, best_miou)
                model.train()
            if cur_itr >= args.total_itrs:
                break
        epoch += 1

    log('done, best mIoU %.4f' % best_miou)
    dist.destroy_process_group()


@torch.no_grad()
def validate(model, loader):
    model.eval()
    metrics = StreamSegMetrics(args.num_classes)
    for images, labels in loader:
        images = images.cuda(non_blocking=True)
        labels = labels.cuda(non_blocking=True)
        out = model.module(images)['out']
        pred = out.argmax(1)
        metrics.update(pred.flatten(), labels.flatten())
    metrics.reduce()
    return metrics.miou()


if __name__ == '__main__':
    main()
