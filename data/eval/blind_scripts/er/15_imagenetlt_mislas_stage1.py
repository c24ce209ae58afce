"""MiSLAS stage 1 on ImageNet-LT (Zhong et al., CVPR 2021): mixup + instance-balanced
sampling, ResNet-50, 180 epochs. Stage 2 (label-aware smoothing + shifted BN) lives in
mislas_stage2.py.

    torchrun --nproc_per_node=8 imagenetlt_mislas_stage1.py --data /data/imagenet --lt-list /data/ImageNet_LT
"""
import argparse
import os
import shutil
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision.models as models
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms


parser = argparse.ArgumentParser(description="MiSLAS stage-1")
parser.add_argument("--data", default="/data/imagenet")
parser.add_argument("--lt-list", default="/data/ImageNet_LT")
parser.add_argument("--arch", default="resnet50")
parser.add_argument("--epochs", type=int, default=180)
parser.add_argument("--batch-size", type=int, default=32, help="per GPU; 8 x 32 = 256")
parser.add_argument("--lr", type=float, default=0.1, help="lr for a total batch of 256")
parser.add_argument("--wd", type=float, default=5e-4)
parser.add_argument("--mixup-alpha", type=float, default=0.2)
parser.add_argument("--eval-freq", type=int, default=10)
parser.add_argument("--workers", type=int, default=8)
parser.add_argument("--save-dir", default="saved/mislas_imagenetlt_stage1")


class LT_Dataset(Dataset):
    def __init__(self, root, txt, transform=None):
        self.img_path, self.labels = [], []
        self.transform = transform
        with open(txt) as f:
            for line in f:
                self.img_path.append(os.path.join(root, line.split()[0]))
                self.labels.append(int(line.split()[1]))
        self.cls_num_list = np.bincount(self.labels, minlength=1000).tolist()

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        with open(self.img_path[index], "rb") as f:
            sample = Image.open(f).convert("RGB")
        if self.transform is not None:
            sample = self.transform(sample)
        return sample, self.labels[index]


def mixup_data(x, y, alpha):
    lam = np.random.beta(alpha, alpha) if alpha > 0 else 1.0
    index = torch.randperm(x.size(0), device=x.device)
    return lam * x + (1 - lam) * x[index], y, y[index], lam


def reduce_tensor(t):
    rt = t.clone()
    dist.all_reduce(rt, op=dist.ReduceOp.SUM)
    return rt


@torch.no_grad()
def validate(val_loader, model, cls_num_list, device):
    model.eval()
    num_classes = len(cls_num_list)
    class_correct = torch.zeros(num_classes, device=device)
    class_total = torch.zeros(num_classes, device=device)
    for images, target in val_loader:
        images, target = images.to(device, non_blocking=True), target.to(device, non_blocking=True)
        pred = model(images).argmax(dim=1)
        class_total += torch.bincount(target, minlength=num_classes).float()
        class_correct += torch.bincount(target, weights=(pred == target).float(), minlength=num_classes)
    class_correct = reduce_tensor(class_correct)
    class_total = reduce_tensor(class_total)
    acc = (class_correct / class_total.clamp(min=1)).cpu().numpy()
    cls_num = np.array(cls_num_list)
    return {"top1": 100.0 * class_correct.sum().item() / class_total.sum().item(),
            "many": 100.0 * acc[cls_num > 100].mean(),
            "medium": 100.0 * acc[(cls_num <= 100) & (cls_num >= 20)].mean(),
            "few": 100.0 * acc[cls_num < 20].mean()}


def adjust_learning_rate(optimizer, epoch, it, iters, args, lr0):
    # 5-epoch linear warmup, then cosine
    e = epoch + it / iters
    lr = lr0 * e / 5 if e < 5 else lr0 * 0.5 * (1 + np.cos(np.pi * (e - 5) / (args.epochs - 5)))
    for g in optimizer.param_groups:
        g["lr"] = lr


def main():
    args = parser.parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    is_main = rank == 0

    normalize = transforms.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
    train_dataset = LT_Dataset(args.data, os.path.join(args.lt_list, "ImageNet_LT_train.txt"), transforms.Compose([
        transforms.RandomResizedCrop(224), transforms.RandomHorizontalFlip(),
        transforms.ColorJitter(0.4, 0.4, 0.4, 0), transforms.ToTensor(), normalize]))
    val_dataset = LT_Dataset(args.data, os.path.join(args.lt_list, "ImageNet_LT_val.txt"), transforms.Compose([
        transforms.Resize(256), transforms.CenterCrop(224), transforms.ToTensor(), normalize]))
    cls_num_list = train_dataset.cls_num_list

    train_sampler = DistributedSampler(train_dataset)
    train_loader = DataLoader(train_dataset, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    # ImageNet_LT_val.txt: 20 images x 1000 classes; split over ranks without padding
    val_subset = torch.utils.data.Subset(val_dataset, list(range(rank, len(val_dataset), world_size)))
    val_loader = DataLoader(val_subset, batch_size=128, shuffle=False, num_workers=args.workers, pin_memory=True)

    model = models.__dict__[args.arch](num_classes=1000)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])

    lr0 = args.lr * args.batch_size * world_size / 256
    optimizer = torch.optim.SGD(model.parameters(), lr0, momentum=0.9, weight_decay=args.wd)
    criterion = nn.CrossEntropyLoss().to(device)

    best_acc1 = 0.0
    if is_main:
        os.makedirs(args.save_dir, exist_ok=True)
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        end = time.time()
        loss_sum = torch.zeros(2, device=device)
        for i, (images, target) in enumerate(train_loader):
            adjust_learning_rate(optimizer, epoch, i, len(train_loader), args, lr0)
            images, target = images.to(device, non_blocking=True), target.to(device, non_blocking=True)
            mixed, y_a, y_b, lam = mixup_data(images, target, args.mixup_alpha)
            output = model(mixed)
            loss = lam * criterion(output, y_a) + (1 - lam) * criterion(output, y_b)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            loss_sum += torch.stack([loss.detach(), torch.ones((), device=device)])
        loss_sum = reduce_tensor(loss_sum)
        if is_main:
            print(f"Epoch [{epoch}] loss {loss_sum[0].item() / loss_sum[1].item():.4f} "
                  f"lr {optimizer.param_groups[0]['lr']:.5f} time {time.time() - end:.0f}s", flush=True)

        if is_main and ((epoch + 1) % args.eval_freq == 0 or epoch + 1 == args.epochs):
            stats = validate(val_loader, model.module, cls_num_list, device)
            print(f"  * Acc@1 {stats['top1']:.3f} Many {stats['many']:.3f} "
                  f"Medium {stats['medium']:.3f} Few {stats['few']:.3f}", flush=True)
            is_best = stats["top1"] > best_acc1
            best_acc1 = max(best_acc1, stats["top1"])
            path = os.path.join(args.save_dir, "ckpt.pth.tar")
            torch.save({"epoch": epoch + 1, "arch": args.arch, "state_dict_model": model.module.state_dict(),
                        "best_acc1": best_acc1, "optimizer": optimizer.state_dict()}, path)
            if is_best:
                shutil.copyfile(path, os.path.join(args.save_dir, "model_best.pth.tar"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
