# MAE pretraining (ViT-B/16, mask 0.75) -- trimmed copy of our lab version
# torchrun --nproc_per_node=8 13_mae_pretrain.py --batch_size 64 --accum_iter 1 --blr 1.5e-4 --epochs 400
import os
import math
import time
import json
import argparse
import datetime
from contextlib import nullcontext

import numpy as np
import torch
import torch.nn as nn
import torch.distributed as dist
import torchvision.datasets as datasets
import torchvision.transforms as transforms
from torch.utils.tensorboard import SummaryWriter
from timm.models.vision_transformer import PatchEmbed, Block


def get_args_parser():
    parser = argparse.ArgumentParser('MAE pre-training', add_help=False)
    parser.add_argument('--batch_size', default=64, type=int, help='Batch size per GPU')
    parser.add_argument('--epochs', default=400, type=int)
    parser.add_argument('--accum_iter', default=1, type=int)
    parser.add_argument('--input_size', default=224, type=int)
    parser.add_argument('--mask_ratio', default=0.75, type=float)
    parser.add_argument('--norm_pix_loss', action='store_true')
    parser.add_argument('--weight_decay', type=float, default=0.05)
    parser.add_argument('--blr', type=float, default=1.5e-4, help='base lr: lr = blr * eff_batch / 256')
    parser.add_argument('--min_lr', type=float, default=0.)
    parser.add_argument('--warmup_epochs', type=int, default=40)
    parser.add_argument('--data_path', default='/datasets01/imagenet_full_size/061417/')
    parser.add_argument('--output_dir', default='./output_dir')
    parser.add_argument('--resume', default='')
    parser.add_argument('--num_workers', default=10, type=int)
    parser.add_argument('--seed', default=0, type=int)
    return parser


class MaskedAutoencoderViT(nn.Module):
    def __init__(self, img_size=224, patch=16, dim=768, depth=12, heads=12, ddim=512, ddepth=8, dheads=16,
                 norm_pix_loss=False):
        super().__init__()
        self.patch_embed = PatchEmbed(img_size, patch, 3, dim)
        n = self.patch_embed.num_patches
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, n + 1, dim), requires_grad=False)
        self.blocks = nn.ModuleList([Block(dim, heads, 4., qkv_bias=True) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.decoder_embed = nn.Linear(dim, ddim)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, ddim))
        self.decoder_pos_embed = nn.Parameter(torch.zeros(1, n + 1, ddim), requires_grad=False)
        self.decoder_blocks = nn.ModuleList([Block(ddim, dheads, 4., qkv_bias=True) for _ in range(ddepth)])
        self.decoder_norm = nn.LayerNorm(ddim)
        self.decoder_pred = nn.Linear(ddim, patch ** 2 * 3)
        self.p = patch
        self.norm_pix_loss = norm_pix_loss
        nn.init.normal_(self.cls_token, std=.02)
        nn.init.normal_(self.mask_token, std=.02)
        nn.init.trunc_normal_(self.pos_embed, std=.02)
        nn.init.trunc_normal_(self.decoder_pos_embed, std=.02)

    def patchify(self, imgs):
        p, h = self.p, imgs.shape[2] // self.p
        x = imgs.reshape(imgs.shape[0], 3, h, p, h, p)
        return torch.einsum('nchpwq->nhwpqc', x).reshape(imgs.shape[0], h * h, p * p * 3)

    def random_masking(self, x, ratio):
        N, L, D = x.shape
        keep = int(L * (1 - ratio))
        noise = torch.rand(N, L, device=x.device)
        ids_shuffle = torch.argsort(noise, dim=1)
        ids_restore = torch.argsort(ids_shuffle, dim=1)
        x_masked = torch.gather(x, 1, ids_shuffle[:, :keep].unsqueeze(-1).repeat(1, 1, D))
        mask = torch.ones(N, L, device=x.device)
        mask[:, :keep] = 0
        return x_masked, torch.gather(mask, 1, ids_restore), ids_restore

    def forward(self, imgs, mask_ratio=0.75):
        x = self.patch_embed(imgs) + self.pos_embed[:, 1:]
        x, mask, ids_restore = self.random_masking(x, mask_ratio)
        cls = (self.cls_token + self.pos_embed[:, :1]).expand(x.shape[0], -1, -1)
        x = torch.cat([cls, x], 1)
        for blk in self.blocks:
            x = blk(x)
        x = self.decoder_embed(self.norm(x))
        mt = self.mask_token.repeat(x.shape[0], ids_restore.shape[1] + 1 - x.shape[1], 1)
        x_ = torch.cat([x[:, 1:], mt], 1)
        x_ = torch.gather(x_, 1, ids_restore.unsqueeze(-1).repeat(1, 1, x.shape[2]))
        x = torch.cat([x[:, :1], x_], 1) + self.decoder_pos_embed
        for blk in self.decoder_blocks:
            x = blk(x)
        pred = self.decoder_pred(self.decoder_norm(x))[:, 1:]
        target = self.patchify(imgs)
        if self.norm_pix_loss:
            mean, var = target.mean(-1, keepdim=True), target.var(-1, keepdim=True)
            target = (target - mean) / (var + 1.e-6) ** .5
        loss = ((pred - target) ** 2).mean(-1)
        return (loss * mask).sum() / mask.sum()


def adjust_learning_rate(optimizer, epoch, args):
    if epoch < args.warmup_epochs:
        lr = args.lr * epoch / args.warmup_epochs
    else:
        lr = args.min_lr + (args.lr - args.min_lr) * 0.5 * \
            (1. + math.cos(math.pi * (epoch - args.warmup_epochs) / (args.epochs - args.warmup_epochs)))
    for g in optimizer.param_groups:
        g['lr'] = lr * g.get('lr_scale', 1.0)
    return lr


def param_groups_wd(model, wd):
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim == 1 or n in ('cls_token', 'mask_token') else decay).append(p)
    return [{'params': no_decay, 'weight_decay': 0.}, {'params': decay, 'weight_decay': wd}]


def main(args):
    local_rank = int(os.environ['LOCAL_RANK'])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend='nccl', init_method='env://')
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device('cuda')
    torch.manual_seed(args.seed + rank)
    np.random.seed(args.seed + rank)

    tf = transforms.Compose([transforms.RandomResizedCrop(args.input_size, scale=(0.2, 1.0), interpolation=3),
                             transforms.RandomHorizontalFlip(), transforms.ToTensor(),
                             transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
    dataset_train = datasets.ImageFolder(os.path.join(args.data_path, 'train'), transform=tf)
    sampler_train = torch.utils.data.DistributedSampler(dataset_train, num_replicas=world, rank=rank, shuffle=True)
    data_loader_train = torch.utils.data.DataLoader(dataset_train, sampler=sampler_train, batch_size=args.batch_size,
                                                    num_workers=args.num_workers, pin_memory=True, drop_last=True)
    log_writer = None
    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
        log_writer = SummaryWriter(log_dir=args.output_dir)

    torch.manual_seed(args.seed)
    model = MaskedAutoencoderViT(norm_pix_loss=args.norm_pix_loss).to(device)
    model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[local_rank])
    model_without_ddp = model.module

    eff_batch_size = args.batch_size * args.accum_iter
    args.lr = args.blr * eff_batch_size / 256
    if rank == 0:
        print('base lr: %.2e  actual lr: %.2e  effective batch size: %d' % (args.blr, args.lr, eff_batch_size))

    optimizer = torch.optim.AdamW(param_groups_wd(model_without_ddp, args.weight_decay), lr=args.lr,
                                  betas=(0.9, 0.95))
    scaler = torch.cuda.amp.GradScaler()
    start_epoch = 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location='cpu')
        model_without_ddp.load_state_dict(ckpt['model'])
        optimizer.load_state_dict(ckpt['optimizer'])
        scaler.load_state_dict(ckpt['scaler'])
        start_epoch = ckpt['epoch'] + 1

    start_time = time.time()
    for epoch in range(start_epoch, args.epochs):
        sampler_train.set_epoch(epoch)
        model.train()
        optimizer.zero_grad()
        loss_sum = torch.zeros(2, device=device)
        for it, (samples, _) in enumerate(data_loader_train):
            if it % args.accum_iter == 0:
                adjust_learning_rate(optimizer, it / len(data_loader_train) + epoch, args)
            samples = samples.to(device, non_blocking=True)
            update = (it + 1) % args.accum_iter == 0
            with (nullcontext() if update else model.no_sync()):
                with torch.autocast('cuda'):
                    loss = model(samples, mask_ratio=args.mask_ratio)
                scaler.scale(loss / args.accum_iter).backward()
            if update:
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad()
            loss_sum += torch.stack([loss.detach(), torch.ones((), device=device)])
            if log_writer is not None and update and it % 100 == 0:
                step = int((it / len(data_loader_train) + epoch) * 1000)
                log_writer.add_scalar('train_loss', loss.item(), step)
                log_writer.add_scalar('lr', optimizer.param_groups[0]['lr'], step)
        dist.all_reduce(loss_sum)
        if rank == 0:
            stats = {'epoch': epoch, 'train_loss': (loss_sum[0] / loss_sum[1]).item()}
            print(json.dumps(stats), flush=True)
            with open(os.path.join(args.output_dir, 'log.txt'), 'a') as f:
                f.write(json.dumps(stats) + '\n')
            if epoch % 20 == 0 or epoch + 1 == args.epochs:
                torch.save({'model': model_without_ddp.state_dict(), 'optimizer': optimizer.state_dict(),
                            'scaler': scaler.state_dict(), 'epoch': epoch, 'args': vars(args)},
                           os.path.join(args.output_dir, 'checkpoint-%d.pth' % epoch))

    if rank == 0:
        log_writer.close()
        print('Training time', str(datetime.timedelta(seconds=int(time.time() - start_time))))
    dist.destroy_process_group()


if __name__ == '__main__':
    args = get_args_parser().parse_args()
    main(args)
