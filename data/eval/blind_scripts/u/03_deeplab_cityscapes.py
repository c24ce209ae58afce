# DeepLabV3-ResNet50 on Cityscapes, multi-GPU version
# launch:  torchrun --nproc_per_node=8 03_deeplab_cityscapes.py --data /data/cityscapes --bs 2
import os
import time
import argparse
import random

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from torchvision.models.segmentation import deeplabv3_resnet50
from torchvision.datasets import Cityscapes
from PIL import Image

NUM_CLASSES = 19
IGNORE = 255
MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)
STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)

# cityscapes id -> train id
ID_TO_TRAINID = np.full(256, IGNORE, dtype=np.uint8)
for _c in Cityscapes.classes:
    if 0 <= _c.train_id < NUM_CLASSES:
        ID_TO_TRAINID[_c.id] = _c.train_id

parser = argparse.ArgumentParser()
parser.add_argument('--data', type=str, default='/data/cityscapes')
parser.add_argument('--bs', type=int, default=2, help='images per gpu')
parser.add_argument('--crop', type=int, default=768)
parser.add_argument('--lr', type=float, default=0.01)
parser.add_argument('--iters', type=int, default=80000)
parser.add_argument('--val_every', type=int, default=4000)
parser.add_argument('--workers', type=int, default=4)
parser.add_argument('--exp', type=str, default='exp/deeplabv3_r50')
parser.add_argument('--resume', type=str, default='')
parser.add_argument('--seed', type=int, default=1234)
args = parser.parse_args()


class CityscapesSeg(Dataset):
    def __init__(self, root, split='train', crop=768, scale=(0.5, 2.0)):
        self.ds = Cityscapes(root, split=split, mode='fine', target_type='semantic')
        self.split, self.crop, self.scale = split, crop, scale

    def __len__(self):
        return len(self.ds)

    def __getitem__(self, i):
        img, lbl = self.ds[i]
        if self.split == 'train':
            s = random.uniform(*self.scale)
            w, h = img.size
            nw, nh = int(w * s), int(h * s)
            img = img.resize((nw, nh), Image.BILINEAR)
            lbl = lbl.resize((nw, nh), Image.NEAREST)
            if random.random() < 0.5:
                img = img.transpose(Image.FLIP_LEFT_RIGHT)
                lbl = lbl.transpose(Image.FLIP_LEFT_RIGHT)
        img = (np.asarray(img, dtype=np.float32) / 255. - MEAN) / STD
        lbl = ID_TO_TRAINID[np.asarray(lbl, dtype=np.uint8)]
        if self.split == 'train':
            h, w = lbl.shape
            ph, pw = max(self.crop - h, 0), max(self.crop - w, 0)
            if ph or pw:
                img = np.pad(img, ((0, ph), (0, pw), (0, 0)))
                lbl = np.pad(lbl, ((0, ph), (0, pw)), constant_values=IGNORE)
            h, w = lbl.shape
            y, x = random.randint(0, h - self.crop), random.randint(0, w - self.crop)
            img = img[y:y + self.crop, x:x + self.crop]
            lbl = lbl[y:y + self.crop, x:x + self.crop]
        img = torch.from_numpy(np.ascontiguousarray(img.transpose(2, 0, 1)))
        lbl = torch.from_numpy(np.ascontiguousarray(lbl)).long()
        return img, lbl


def fast_hist(pred, label, n):
    k = label != IGNORE
    return torch.bincount(n * label[k] + pred[k], minlength=n * n).reshape(n, n)


def evaluate(model, loader, device):
    model.eval()
    hist = torch.zeros(NUM_CLASSES, NUM_CLASSES, dtype=torch.long, device=device)
    with torch.no_grad():
        for img, lbl in loader:
            img, lbl = img.to(device), lbl.to(device)
            out = model(img)['out']
            pred = out.argmax(1)
            hist += fast_hist(pred.flatten(), lbl.flatten(), NUM_CLASSES)
    iou = hist.diag().float() / (hist.sum(0) + hist.sum(1) - hist.diag()).float().clamp(min=1)
    pix_acc = hist.diag().sum().float() / hist.sum().clamp(min=1).float()
    model.train()
    return iou.mean().item(), pix_acc.item(), iou.cpu().numpy()


def main():
    local_rank = int(os.environ['LOCAL_RANK'])
    torch.cuda.set_device(local_rank)
    dist.init_process_group('nccl')
    rank = dist.get_rank()
    world = dist.get_world_size()
    device = torch.device(f'cuda:{local_rank}')

    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed)

    train_set = CityscapesSeg(args.data, 'train', crop=args.crop)
    val_set = CityscapesSeg(args.data, 'val')
    train_sampler = DistributedSampler(train_set, shuffle=True)
    val_sampler = DistributedSampler(val_set, shuffle=False)
    train_loader = DataLoader(train_set, batch_size=args.bs, sampler=train_sampler, num_workers=args.workers,
                              pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=1, sampler=val_sampler, num_workers=2)

    model = deeplabv3_resnet50(weights=None, weights_backbone='IMAGENET1K_V1', num_classes=NUM_CLASSES, aux_loss=True)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = nn.parallel.DistributedDataParallel(model, device_ids=[local_rank], output_device=local_rank)

    params = [
        {'params': model.module.backbone.parameters(), 'lr': args.lr},
        {'params': list(model.module.classifier.parameters()) + list(model.module.aux_classifier.parameters()),
         'lr': args.lr * 10},
    ]
    optimizer = torch.optim.SGD(params, lr=args.lr, momentum=0.9, weight_decay=1e-4)
    base_lrs = [g['lr'] for g in optimizer.param_groups]
    criterion = nn.CrossEntropyLoss(ignore_index=IGNORE)

    it = 0
    best_miou = 0.0
    if args.resume:
        ck = torch.load(args.resume, map_location=device)
        model.module.load_state_dict(ck['model'])
        optimizer.load_state_dict(ck['optim'])
        it = ck['iter']
        best_miou = ck.get('best_miou', 0.0)

    writer = SummaryWriter(os.path.join(args.exp, 'tb')) if rank == 0 else None
    if rank == 0:
        os.makedirs(args.exp, exist_ok=True)
        print(f'world size {world}, global batch {args.bs * world}, {len(train_loader)} iters/epoch')

    epoch = it // len(train_loader)
    model.train()
    t0 = time.time()
    while it < args.iters:
        train_sampler.set_epoch(epoch)
        for img, lbl in train_loader:
            if it >= args.iters:
                break
            img = img.to(device, non_blocking=True)
            lbl = lbl.to(device, non_blocking=True)
            factor = (1 - it / args.iters) ** 0.9
            for g, blr in zip(optimizer.param_groups, base_lrs):
                g['lr'] = blr * factor

            out = model(img)
            loss = criterion(out['out'], lbl) + 0.4 * criterion(out['aux'], lbl)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            it += 1

            if rank == 0 and it % 50 == 0:
                el = time.time() - t0
                print(f'it {it}/{args.iters} loss {loss.item():.4f} lr {optimizer.param_groups[0]["lr"]:.5f} '
                      f'{el / 50:.3f}s/it')
                writer.add_scalar('train/loss', loss.item(), it)
                t0 = time.time()

            if it % args.val_every == 0 or it == args.iters:
                miou, acc, ious = evaluate(model, val_loader, device)
                if rank == 0:
                    print(f'[val] it {it} mIoU {miou * 100:.2f} pixAcc {acc * 100:.2f}')
                    writer.add_scalar('val/mIoU', miou, it)
                    writer.add_scalar('val/pixAcc', acc, it)
                    state = {'model': model.module.state_dict(), 'optim': optimizer.state_dict(),
                             'iter': it, 'best_miou': max(best_miou, miou)}
                    torch.save(state, os.path.join(args.exp, 'last.pth'))
                    if miou > best_miou:
                        torch.save(state, os.path.join(args.exp, 'best.pth'))
                        print(f'  new best {miou * 100:.2f} (was {best_miou * 100:.2f})')
                best_miou = max(best_miou, miou)
        epoch += 1

    if rank == 0:
        print(f'done. best mIoU {best_miou * 100:.2f}')
        writer.close()
    dist.destroy_process_group()


if __name__ == '__main__':
    main()
