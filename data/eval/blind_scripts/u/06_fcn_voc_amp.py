"""FCN / DeepLabV3+ style training on PASCAL VOC 2012 (SBD augmented), DDP + AMP.

    torchrun --standalone --nproc_per_node=4 06_fcn_voc_amp.py --cfg configs/voc_r101.yaml

Config is a small yaml, command line overrides with --opts key=value.
"""
import argparse
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.cuda.amp import GradScaler, autocast
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Sampler
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from torchvision.models.segmentation import deeplabv3_resnet101

from datasets.voc import VOCSegmentation  # repo-local dataset with joint transforms

DEFAULTS = dict(
    data_root='/data/VOCdevkit/VOC2012', num_classes=21, crop=512, batch_per_gpu=4,
    epochs=50, lr=0.007, momentum=0.9, wd=1e-4, workers=4, out='work_dirs/voc_r101',
    eval_every=5, amp=True,
)


def load_cfg():
    ap = argparse.ArgumentParser()
    ap.add_argument('--cfg', default='')
    ap.add_argument('--resume', default='')
    ap.add_argument('--opts', nargs='*', default=[])
    a = ap.parse_args()
    cfg = dict(DEFAULTS)
    if a.cfg:
        with open(a.cfg) as f:
            cfg.update(yaml.safe_load(f) or {})
    for kv in a.opts:
        k, v = kv.split('=', 1)
        cfg[k] = yaml.safe_load(v)
    cfg['resume'] = a.resume
    return argparse.Namespace(**cfg)


class ShardSampler(Sampler):
    """Contiguous, un-padded shard of the dataset for evaluation.

    Ranks may get a different number of images; that is fine because eval runs on
    model.module (no DDP hooks) and only the final confusion matrix is all-reduced.
    """

    def __init__(self, n, rank, world):
        per = int(math.ceil(n / world))
        self.idx = list(range(rank * per, min(n, (rank + 1) * per)))

    def __iter__(self):
        return iter(self.idx)

    def __len__(self):
        return len(self.idx)


def confusion(pred, gt, n):
    m = gt != 255
    return torch.bincount(gt[m] * n + pred[m], minlength=n * n).view(n, n)


@torch.no_grad()
def evaluate(net, loader, cfg, device):
    net.eval()
    conf = torch.zeros(cfg.num_classes, cfg.num_classes, dtype=torch.int64, device=device)
    for img, gt in loader:
        img, gt = img.to(device, non_blocking=True), gt.to(device, non_blocking=True)
        with autocast(enabled=cfg.amp):
            logits = net(img)['out']
        logits = F.interpolate(logits.float(), size=gt.shape[-2:], mode='bilinear', align_corners=False)
        conf += confusion(logits.argmax(1).flatten(), gt.flatten(), cfg.num_classes)
    dist.all_reduce(conf, op=dist.ReduceOp.SUM)
    conf = conf.double()
    iou = conf.diag() / (conf.sum(0) + conf.sum(1) - conf.diag()).clamp(min=1)
    net.train()
    return iou.mean().item(), iou.cpu().numpy()


def main():
    cfg = load_cfg()
    local_rank = int(os.environ['LOCAL_RANK'])
    torch.cuda.set_device(local_rank)
    dist.init_process_group('nccl', init_method='env://')
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device('cuda', local_rank)
    is_master = rank == 0

    train_set = VOCSegmentation(cfg.data_root, split='train_aug', crop=cfg.crop, train=True)
    val_set = VOCSegmentation(cfg.data_root, split='val', train=False)
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=cfg.batch_per_gpu, sampler=train_sampler,
                              num_workers=cfg.workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=1, sampler=ShardSampler(len(val_set), rank, world),
                            num_workers=cfg.workers, pin_memory=True)

    net = deeplabv3_resnet101(weights=None, weights_backbone='IMAGENET1K_V2', num_classes=cfg.num_classes,
                              aux_loss=False)
    # 4 images per GPU -> BN statistics must be computed over the whole global batch
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net).to(device)
    net = DDP(net, device_ids=[local_rank], output_device=local_rank)

    backbone_params = list(net.module.backbone.parameters())
    head_params = list(net.module.classifier.parameters())
    # lr in cfg is for 16 images; scale linearly with the global batch
    base_lr = cfg.lr * cfg.batch_per_gpu * world / 16
    optimizer = torch.optim.SGD([{'params': backbone_params, 'lr': base_lr},
                                 {'params': head_params, 'lr': base_lr * 10}],
                                lr=base_lr, momentum=cfg.momentum, weight_decay=cfg.wd)
    init_lrs = [g['lr'] for g in optimizer.param_groups]
    scaler = GradScaler(enabled=cfg.amp)
    criterion = nn.CrossEntropyLoss(ignore_index=255)

    start_epoch, best = 0, 0.0
    ckpt_path = os.path.join(cfg.out, 'latest.pth')
    resume = cfg.resume or (ckpt_path if os.path.exists(ckpt_path) else '')
    if resume:
        state = torch.load(resume, map_location='cpu')
        net.module.load_state_dict(state['model'])
        optimizer.load_state_dict(state['optimizer'])
        scaler.load_state_dict(state['scaler'])
        start_epoch, best = state['epoch'] + 1, state['best']
        if is_master:
            print(f'resumed from {resume} at epoch {start_epoch}')

    writer = SummaryWriter(os.path.join(cfg.out, 'tb')) if is_master else None
    if is_master:
        os.makedirs(cfg.out, exist_ok=True)
        with open(os.path.join(cfg.out, 'config.yaml'), 'w') as f:
            yaml.safe_dump(vars(cfg), f)

    max_iter = cfg.epochs * len(train_loader)
    for epoch in range(start_epoch, cfg.epochs):
        train_sampler.set_epoch(epoch)
        net.train()
        tic = time.time()
        run_loss = torch.zeros(2, device=device)
        for i, (img, gt) in enumerate(train_loader):
            cur_iter = epoch * len(train_loader) + i
            poly = (1 - cur_iter / max_iter) ** 0.9
            for g, lr0 in zip(optimizer.param_groups, init_lrs):
                g['lr'] = lr0 * poly
            img = img.to(device, non_blocking=True)
            gt = gt.to(device, non_blocking=True)
            with autocast(enabled=cfg.amp):
                out = net(img)['out']
                loss = criterion(out, gt)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            run_loss += torch.stack([loss.detach().float(), torch.ones((), device=device)])
            if is_master and i % 20 == 0:
                writer.add_scalar('train/loss', loss.item(), cur_iter)
                writer.add_scalar('train/lr', optimizer.param_groups[0]['lr'], cur_iter)

        dist.all_reduce(run_loss)
        if is_master:
            print(f'[{epoch}] loss {run_loss[0].item() / run_loss[1].item():.4f} time {time.time() - tic:.0f}s')

        if (epoch + 1) % cfg.eval_every == 0 or epoch + 1 == cfg.epochs:
            miou, ious = evaluate(net.module, val_loader, cfg, device)
            if is_master:
                print(f'[{epoch}] mIoU {miou * 100:.2f}  ' + ' '.join(f'{x * 100:.1f}' for x in ious))
                writer.add_scalar('val/mIoU', miou, epoch)
            best = max(best, miou)
            if is_master and best == miou:
                torch.save(net.module.state_dict(), os.path.join(cfg.out, 'best_model.pth'))

        if is_master:
            tmp = ckpt_path + '.tmp'
            torch.save({'model': net.module.state_dict(), 'optimizer': optimizer.state_dict(),
                        'scaler': scaler.state_dict(), 'epoch': epoch, 'best': best}, tmp)
            os.replace(tmp, ckpt_path)
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == '__main__':
    main()
