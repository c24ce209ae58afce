"""SimMIM pre-training (ViT-B/16, 192px, random 32x32 block masking, l1 pixel regression)."""
import argparse
import datetime
import glob
import logging
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision.transforms as T
from timm.models.vision_transformer import VisionTransformer
from torch.nn.parallel import DistributedDataParallel
from torchvision.datasets import ImageFolder

logger = logging.getLogger("simmim")


def parse_option():
    parser = argparse.ArgumentParser("SimMIM pre-training")
    parser.add_argument("--data-path", type=str, default="/mnt/imagenet/train")
    parser.add_argument("--output", type=str, default="output/simmim_vitb")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--epochs", type=int, default=800)
    parser.add_argument("--warmup-epochs", type=int, default=10)
    parser.add_argument("--base-lr", type=float, default=1e-4)
    parser.add_argument("--min-lr", type=float, default=1e-5)
    parser.add_argument("--weight-decay", type=float, default=0.05)
    parser.add_argument("--img-size", type=int, default=192)
    parser.add_argument("--mask-patch-size", type=int, default=32)
    parser.add_argument("--mask-ratio", type=float, default=0.6)
    parser.add_argument("--clip-grad", type=float, default=5.0)
    parser.add_argument("--save-freq", type=int, default=10)
    parser.add_argument("--print-freq", type=int, default=100)
    parser.add_argument("--num-workers", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


class MaskGenerator:
    def __init__(self, input_size=192, mask_patch_size=32, model_patch_size=16, mask_ratio=0.6):
        self.rand_size = input_size // mask_patch_size
        self.scale = mask_patch_size // model_patch_size
        self.token_count = self.rand_size ** 2
        self.mask_count = int(np.ceil(self.token_count * mask_ratio))

    def __call__(self):
        mask_idx = np.random.permutation(self.token_count)[:self.mask_count]
        mask = np.zeros(self.token_count, dtype=int)
        mask[mask_idx] = 1
        mask = mask.reshape((self.rand_size, self.rand_size))
        return mask.repeat(self.scale, axis=0).repeat(self.scale, axis=1)


class SimMIMTransform:
    def __init__(self, args):
        self.transform_img = T.Compose([
            T.Lambda(lambda img: img.convert("RGB") if img.mode != "RGB" else img),
            T.RandomResizedCrop(args.img_size, scale=(0.67, 1.), ratio=(3. / 4., 4. / 3.)),
            T.RandomHorizontalFlip(),
            T.ToTensor(),
            T.Normalize(mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225)),
        ])
        self.mask_generator = MaskGenerator(args.img_size, args.mask_patch_size, 16, args.mask_ratio)

    def __call__(self, img):
        return self.transform_img(img), self.mask_generator()


class VisionTransformerForSimMIM(VisionTransformer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        assert self.num_classes == 0
        self.mask_token = nn.Parameter(torch.zeros(1, 1, self.embed_dim))
        nn.init.trunc_normal_(self.mask_token, std=.02)

    def forward(self, x, mask):
        x = self.patch_embed(x)
        B, L, _ = x.shape
        mask_tokens = self.mask_token.expand(B, L, -1)
        w = mask.flatten(1).unsqueeze(-1).type_as(mask_tokens)
        x = x * (1 - w) + mask_tokens * w
        x = self._pos_embed(x)
        x = self.blocks(x)
        x = self.norm(x)
        x = x[:, 1:]
        H = W = int(L ** 0.5)
        return x.permute(0, 2, 1).reshape(B, -1, H, W)


class SimMIM(nn.Module):
    def __init__(self, encoder, encoder_stride=16):
        super().__init__()
        self.encoder = encoder
        self.encoder_stride = encoder_stride
        self.decoder = nn.Sequential(
            nn.Conv2d(encoder.num_features, encoder_stride ** 2 * 3, kernel_size=1),
            nn.PixelShuffle(encoder_stride))
        self.patch_size = 16

    def forward(self, x, mask):
        z = self.encoder(x, mask)
        x_rec = self.decoder(z)
        mask = mask.repeat_interleave(self.patch_size, 1).repeat_interleave(self.patch_size, 2).unsqueeze(1).contiguous()
        loss_recon = F.l1_loss(x, x_rec, reduction="none")
        return (loss_recon * mask).sum() / (mask.sum() + 1e-5) / 3


def build_optimizer(model, args):
    skip = {"pos_embed", "cls_token", "mask_token"}
    has_decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if len(param.shape) == 1 or name.endswith(".bias") or name.split(".")[-1] in skip:
            no_decay.append(param)
        else:
            has_decay.append(param)
    groups = [{"params": has_decay}, {"params": no_decay, "weight_decay": 0.}]
    return torch.optim.AdamW(groups, eps=1e-8, betas=(0.9, 0.999), lr=args.lr, weight_decay=args.weight_decay)


def lr_at(step, total_steps, warmup_steps, base_lr, min_lr):
    if step < warmup_steps:
        return base_lr * step / max(1, warmup_steps)
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return min_lr + 0.5 * (base_lr - min_lr) * (1 + np.cos(np.pi * progress))


def save_checkpoint(args, epoch, model, optimizer, scaler):
    save_state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                  "scaler": scaler.state_dict(), "epoch": epoch, "config": vars(args)}
    save_path = os.path.join(args.output, f"ckpt_epoch_{epoch}.pth")
    logger.info(f"{save_path} saving......")
    torch.save(save_state, save_path)
    logger.info(f"{save_path} saved !!!")


def auto_resume_helper(output_dir):
    checkpoints = glob.glob(os.path.join(output_dir, "ckpt_epoch_*.pth"))
    if not checkpoints:
        return None
    return max(checkpoints, key=os.path.getmtime)


def main():
    args = parse_option()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    dist.barrier()

    torch.manual_seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    os.makedirs(args.output, exist_ok=True)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARN,
                        format=f"[%(asctime)s rank{rank}] %(message)s")

    # linear scaling of the lr with the total batch size (reference batch 512)
    args.lr = args.base_lr * args.batch_size * world_size / 512.0
    args.min_lr = args.min_lr * args.batch_size * world_size / 512.0

    dataset = ImageFolder(args.data_path, SimMIMTransform(args))
    sampler = torch.utils.data.DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True)
    dataloader = torch.utils.data.DataLoader(dataset, args.batch_size, sampler=sampler, num_workers=args.num_workers,
                                             pin_memory=True, drop_last=True)

    encoder = VisionTransformerForSimMIM(img_size=args.img_size, patch_size=16, embed_dim=768, depth=12, num_heads=12,
                                         num_classes=0, drop_path_rate=0.1)
    model = SimMIM(encoder).cuda()
    optimizer = build_optimizer(model, args)
    scaler = torch.cuda.amp.GradScaler()
    model = DistributedDataParallel(model, device_ids=[local_rank], broadcast_buffers=False)
    model_without_ddp = model.module
    n_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    logger.info(f"number of params: {n_params}")

    start_epoch = 0
    resume_file = auto_resume_helper(args.output)
    if resume_file:
        logger.info(f"auto resuming from {resume_file}")
        ckpt = torch.load(resume_file, map_location="cpu")
        model_without_ddp.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch = ckpt["epoch"] + 1
        del ckpt

    steps_per_epoch = len(dataloader)
    total_steps = args.epochs * steps_per_epoch
    warmup_steps = args.warmup_epochs * steps_per_epoch

    logger.info("Start training")
    start_time = time.time()
    for epoch in range(start_epoch, args.epochs):
        dataloader.sampler.set_epoch(epoch)
        model.train()
        loss_meter = torch.zeros(2, device="cuda")
        tic = time.time()
        for idx, (img, mask) in enumerate(dataloader):
            step = epoch * steps_per_epoch + idx
            lr = lr_at(step, total_steps, warmup_steps, args.lr, args.min_lr)
            for g in optimizer.param_groups:
                g["lr"] = lr
            img = img.cuda(non_blocking=True)
            mask = mask.cuda(non_blocking=True)
            with torch.cuda.amp.autocast():
                loss = model(img, mask)
            optimizer.zero_grad()
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)
            scaler.step(optimizer)
            scaler.update()
            loss_meter[0] += loss.detach()
            loss_meter[1] += 1
            if idx % args.print_freq == 0:
                mem = torch.cuda.max_memory_allocated() / (1024.0 * 1024.0)
                logger.info(f"Train: [{epoch}/{args.epochs}][{idx}/{steps_per_epoch}] lr {lr:.6f} "
                            f"loss {loss.item():.4f} grad_norm {grad_norm:.4f} mem {mem:.0f}MB")
        dist.all_reduce(loss_meter)
        logger.info(f"EPOCH {epoch} avg loss {(loss_meter[0] / loss_meter[1]).item():.4f} "
                    f"takes {datetime.timedelta(seconds=int(time.time() - tic))}")
        if epoch % args.save_freq == 0 or epoch == args.epochs - 1:
            save_checkpoint(args, epoch, model_without_ddp, optimizer, scaler)

    logger.info(f"Training time {datetime.timedelta(seconds=int(time.time() - start_time))}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
