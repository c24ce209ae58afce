"""Semantic segmentation on ADE20K (150 classes): DeepLabV3 ResNet-101, poly schedule, 160k iterations."""
import argparse
import datetime
import json
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
import torchvision
import torchvision.transforms.functional as TF
from PIL import Image
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler


def is_dist_avail_and_initialized():
    return dist.is_available() and dist.is_initialized()


def get_rank():
    return dist.get_rank() if is_dist_avail_and_initialized() else 0


def get_world_size():
    return dist.get_world_size() if is_dist_avail_and_initialized() else 1


def is_main_process():
    return get_rank() == 0


def save_on_master(*args, **kwargs):
    if is_main_process():
        torch.save(*args, **kwargs)


def init_distributed_mode(args):
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        args.rank = int(os.environ["RANK"])
        args.world_size = int(os.environ["WORLD_SIZE"])
        args.gpu = int(os.environ["LOCAL_RANK"])
    elif "SLURM_PROCID" in os.environ:
        args.rank = int(os.environ["SLURM_PROCID"])
        args.world_size = int(os.environ["SLURM_NTASKS"])
        args.gpu = args.rank % torch.cuda.device_count()
    else:
        args.distributed = False
        return
    args.distributed = True
    torch.cuda.set_device(args.gpu)
    dist.init_process_group(backend="nccl", init_method=args.dist_url, world_size=args.world_size, rank=args.rank)
    dist.barrier()


class ShardSampler(Sampler):
    """Non-padded split of the validation set: every image is evaluated exactly once."""

    def __init__(self, dataset):
        self.indices = list(range(len(dataset)))[get_rank()::get_world_size()]

    def __iter__(self):
        return iter(self.indices)

    def __len__(self):
        return len(self.indices)


class ADE20K(Dataset):
    mean, std = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]

    def __init__(self, root, split, crop_size=512, scale=(0.5, 2.0)):
        self.img_dir = os.path.join(root, "images", split)
        self.ann_dir = os.path.join(root, "annotations", split)
        self.files = sorted(f[:-4] for f in os.listdir(self.img_dir) if f.endswith(".jpg"))
        self.train = split == "training"
        self.crop_size, self.scale = crop_size, scale

    def __len__(self):
        return len(self.files)

    def __getitem__(self, idx):
        img = Image.open(os.path.join(self.img_dir, self.files[idx] + ".jpg")).convert("RGB")
        lbl = Image.open(os.path.join(self.ann_dir, self.files[idx] + ".png"))
        if self.train:
            s = random.uniform(*self.scale)
            w, h = img.size
            ratio = s * min(2048 / max(w, h), 512 / min(w, h))
            size = (int(h * ratio + 0.5), int(w * ratio + 0.5))
            img = TF.resize(img, size, interpolation=TF.InterpolationMode.BILINEAR)
            lbl = TF.resize(lbl, size, interpolation=TF.InterpolationMode.NEAREST)
            pad_h, pad_w = max(self.crop_size - size[0], 0), max(self.crop_size - size[1], 0)
            img = TF.pad(img, [0, 0, pad_w, pad_h], fill=0)
            lbl = TF.pad(lbl, [0, 0, pad_w, pad_h], fill=0)
            top = random.randint(0, img.size[1] - self.crop_size)
            left = random.randint(0, img.size[0] - self.crop_size)
            img = TF.crop(img, top, left, self.crop_size, self.crop_size)
            lbl = TF.crop(lbl, top, left, self.crop_size, self.crop_size)
            if random.random() < 0.5:
                img, lbl = TF.hflip(img), TF.hflip(lbl)
        else:
            img = TF.resize(img, 512, interpolation=TF.InterpolationMode.BILINEAR)
        img = TF.normalize(TF.to_tensor(img), self.mean, self.std)
        lbl = torch.as_tensor(np.array(lbl), dtype=torch.int64)
        lbl = lbl - 1
        lbl[lbl < 0] = 255  # reduce_zero_label: "other" becomes ignore
        return img, lbl


def poly_lr(optimizer, base_lr, cur_iter, max_iter, warmup_iters=1500, power=0.9, min_lr=1e-4):
    if cur_iter < warmup_iters:
        lr = base_lr * (1e-6 + (1 - 1e-6) * cur_iter / warmup_iters)
    else:
        lr = (base_lr - min_lr) * (1 - cur_iter / max_iter) ** power + min_lr
    for i, group in enumerate(optimizer.param_groups):
        group["lr"] = lr * (10.0 if i == 1 else 1.0)
    return lr


@torch.no_grad()
def evaluate(model, data_loader, num_classes, device):
    model.eval()
    hist = torch.zeros(num_classes, num_classes, dtype=torch.int64, device=device)
    for img, lbl in data_loader:
        img, lbl = img.to(device), lbl.to(device)
        out = model(img)["out"]
        out = F.interpolate(out, size=lbl.shape[-2:], mode="bilinear", align_corners=False)
        pred = out.argmax(1)
        k = lbl != 255
        hist += torch.bincount(num_classes * lbl[k] + pred[k], minlength=num_classes ** 2).view(num_classes, num_classes)
    if is_dist_avail_and_initialized():
        dist.all_reduce(hist)
    hist = hist.double()
    iou = torch.diag(hist) / (hist.sum(0) + hist.sum(1) - torch.diag(hist))
    acc = torch.diag(hist).sum() / hist.sum()
    return {"mIoU": 100 * torch.nanmean(iou).item(), "aAcc": 100 * acc.item()}


def main(args):
    init_distributed_mode(args)
    device = torch.device("cuda")
    torch.manual_seed(args.seed + get_rank())
    random.seed(args.seed + get_rank())
    np.random.seed(args.seed + get_rank())

    train_set = ADE20K(args.data_root, "training", crop_size=args.crop_size)
    val_set = ADE20K(args.data_root, "validation")
    train_sampler = DistributedSampler(train_set, shuffle=True) if args.distributed else None
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler, shuffle=train_sampler is None,
                              num_workers=args.workers, pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(val_set, batch_size=1, sampler=ShardSampler(val_set), num_workers=args.workers)

    model = torchvision.models.segmentation.deeplabv3_resnet101(weights=None, weights_backbone="IMAGENET1K_V1",
                                                                num_classes=args.num_classes, aux_loss=True)
    if args.distributed:
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model.to(device)
    model_without_ddp = model
    if args.distributed:
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[args.gpu])
        model_without_ddp = model.module

    params = [{"params": [p for p in model_without_ddp.backbone.parameters() if p.requires_grad]},
              {"params": [p for n, p in model_without_ddp.named_parameters() if not n.startswith("backbone") and p.requires_grad]}]
    optimizer = torch.optim.SGD(params, lr=args.lr, momentum=0.9, weight_decay=args.weight_decay)
    scaler = torch.cuda.amp.GradScaler(enabled=args.amp)
    criterion = torch.nn.CrossEntropyLoss(ignore_index=255)

    start_iter, best_miou = 0, 0.0
    last_ckpt = os.path.join(args.output_dir, "latest.pth")
    if os.path.exists(last_ckpt):
        ckpt = torch.load(last_ckpt, map_location="cpu")
        model_without_ddp.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scaler.load_state_dict(ckpt["scaler"])
        start_iter, best_miou = ckpt["iter"], ckpt.get("best_miou", 0.0)
        print(f"resumed from {last_ckpt} at iter {start_iter}")

    iters_per_epoch = len(train_loader)
    epoch = start_iter // iters_per_epoch
    cur_iter = start_iter
    t0 = time.time()
    while cur_iter < args.max_iters:
        if train_sampler is not None:
            train_sampler.set_epoch(epoch)
        model.train()
        for img, lbl in train_loader:
            if cur_iter >= args.max_iters:
                break
            lr = poly_lr(optimizer, args.lr, cur_iter, args.max_iters)
            img, lbl = img.to(device, non_blocking=True), lbl.to(device, non_blocking=True)
            with torch.cuda.amp.autocast(enabled=args.amp):
                out = model(img)
                loss = criterion(out["out"], lbl) + 0.4 * criterion(out["aux"], lbl)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            cur_iter += 1

            if cur_iter % args.log_interval == 0 and is_main_process():
                eta = (time.time() - t0) / (cur_iter - start_iter) * (args.max_iters - cur_iter)
                print(f"iter {cur_iter}/{args.max_iters} lr {lr:.2e} loss {loss.item():.4f} "
                      f"eta {datetime.timedelta(seconds=int(eta))}")

            if cur_iter % args.eval_interval == 0 or cur_iter == args.max_iters:
                metrics = evaluate(model_without_ddp, val_loader, args.num_classes, device)
                model.train()
                print(f"iter {cur_iter}: " + json.dumps(metrics))
                state = {"model": model_without_ddp.state_dict(), "optimizer": optimizer.state_dict(),
                         "scaler": scaler.state_dict(), "iter": cur_iter, "best_miou": max(best_miou, metrics["mIoU"])}
                save_on_master(state, last_ckpt)
                if metrics["mIoU"] > best_miou:
                    best_miou = metrics["mIoU"]
                    torch.save(state, os.path.join(args.output_dir, "best_mIoU.pth"))
                if is_main_process():
                    with open(os.path.join(args.output_dir, "log.jsonl"), "a") as f:
                        f.write(json.dumps({"iter": cur_iter, **metrics}) + "\n")
        epoch += 1

    print(f"best mIoU {best_miou:.2f}, total time {datetime.timedelta(seconds=int(time.time() - t0))}")
    if args.distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser("ADE20K semantic segmentation")
    parser.add_argument("--data-root", dest="data_root", default="data/ADEChallengeData2016")
    parser.add_argument("--output-dir", dest="output_dir", default="work_dirs/deeplabv3_r101_ade20k")
    parser.add_argument("--num-classes", dest="num_classes", type=int, default=150)
    parser.add_argument("--crop-size", dest="crop_size", type=int, default=512)
    parser.add_argument("--batch-size", dest="batch_size", type=int, default=4, help="images per GPU")
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--weight-decay", dest="weight_decay", type=float, default=5e-4)
    parser.add_argument("--max-iters", dest="max_iters", type=int, default=160000)
    parser.add_argument("--eval-interval", dest="eval_interval", type=int, default=16000)
    parser.add_argument("--log-interval", dest="log_interval", type=int, default=50)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--amp", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dist_url", default="env://")
    args = parser.parse_args()
    os.makedirs(args.output_dir, exist_ok=True)
    main(args)
