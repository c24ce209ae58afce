"""DeepLabV3-ResNet50 on Cityscapes-style data.

Launch-era script (python -m torch.distributed.launch). Earlier versions used
apex.parallel.convert_syncbn_model + apex DDP; now native SyncBatchNorm/DDP.
"""
import argparse
import os
import time
from collections import OrderedDict

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision.models.segmentation import deeplabv3_resnet50
import torchvision.transforms.v2 as T
from torchvision import tv_tensors


def get_parser():
    parser = argparse.ArgumentParser("deeplab")
    parser.add_argument("--data-root", default="/data/cityscapes")
    parser.add_argument("--num-classes", type=int, default=19)
    parser.add_argument("--crop", type=int, default=768)
    parser.add_argument("--batch-size", type=int, default=8, help="images per GPU")
    parser.add_argument("--iters", type=int, default=40000)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--weight-decay", type=float, default=1e-4)
    parser.add_argument("--aux-weight", type=float, default=0.4)
    parser.add_argument("--backbone-ckpt", default="", help="ImageNet checkpoint saved by the old apex run")
    parser.add_argument("--save-dir", default="work_dirs/deeplabv3")
    parser.add_argument("--eval-every", type=int, default=4000)
    # torch.distributed.launch passes --local-rank (>= 2.0) or --local_rank (older)
    parser.add_argument("--local-rank", "--local_rank", dest="local_rank", type=int,
                        default=int(os.environ.get("LOCAL_RANK", 0)))
    return parser


class SegFolder(Dataset):
    def __init__(self, root, split, crop, train):
        self.imgs = sorted(os.path.join(root, "leftImg8bit", split, c, f)
                           for c in os.listdir(os.path.join(root, "leftImg8bit", split))
                           for f in os.listdir(os.path.join(root, "leftImg8bit", split, c)))
        self.masks = [p.replace("leftImg8bit", "gtFine", 1).replace("_leftImg8bit.png", "_gtFine_labelTrainIds.png")
                      for p in self.imgs]
        if train:
            self.tf = T.Compose([T.RandomResize(int(0.5 * 1024), int(2.0 * 1024)), T.RandomCrop(crop, pad_if_needed=True,
                                 fill={tv_tensors.Mask: 255, "others": 0}), T.RandomHorizontalFlip(),
                                 T.ToDtype(torch.float32, scale=True),
                                 T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
        else:
            self.tf = T.Compose([T.ToDtype(torch.float32, scale=True),
                                 T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])

    def __len__(self):
        return len(self.imgs)

    def __getitem__(self, i):
        img = tv_tensors.Image(torch.from_numpy(np.array(Image.open(self.imgs[i]).convert("RGB"))).permute(2, 0, 1))
        mask = tv_tensors.Mask(torch.from_numpy(np.array(Image.open(self.masks[i]))).long())
        img, mask = self.tf(img, mask)
        return img, mask


def load_backbone(model, path):
    state = torch.load(path, map_location="cpu")
    state = state.get("state_dict", state)
    # checkpoints from the apex DDP run carry a "module." prefix
    state = OrderedDict((k[len("module."):] if k.startswith("module.") else k, v) for k, v in state.items())
    state = {k: v for k, v in state.items() if not k.startswith("fc.")}
    missing, unexpected = model.backbone.load_state_dict(state, strict=False)
    return missing, unexpected


def poly_lr(optimizer, base_lr, it, max_it, power=0.9):
    lr = base_lr * (1 - it / max_it) ** power
    for g in optimizer.param_groups:
        g["lr"] = lr * g.get("lr_mult", 1.0)


@torch.no_grad()
def evaluate(model, loader, num_classes, device):
    model.eval()
    hist = torch.zeros(num_classes, num_classes, dtype=torch.int64, device=device)
    for img, mask in loader:
        img, mask = img.to(device, non_blocking=True), mask.to(device, non_blocking=True)
        pred = model(img)["out"].argmax(1)
        k = mask != 255
        hist += torch.bincount(num_classes * mask[k] + pred[k], minlength=num_classes ** 2).view(num_classes, -1)
    dist.all_reduce(hist)
    iou = hist.diag().float() / (hist.sum(0) + hist.sum(1) - hist.diag()).float().clamp(min=1)
    model.train()
    return iou.mean().item()


def main():
    args = get_parser().parse_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", args.local_rank)
    torch.manual_seed(0)

    model = deeplabv3_resnet50(weights=None, weights_backbone=None, num_classes=args.num_classes, aux_loss=True)
    if args.backbone_ckpt:
        missing, unexpected = load_backbone(model, args.backbone_ckpt)
        if rank == 0:
            print(f"backbone loaded: {len(missing)} missing, {len(unexpected)} unexpected keys")
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model.to(device)
    model = DistributedDataParallel(model, device_ids=[args.local_rank], output_device=args.local_rank)

    params = [
        {"params": model.module.backbone.parameters(), "lr_mult": 1.0},
        {"params": model.module.classifier.parameters(), "lr_mult": 10.0},
        {"params": model.module.aux_classifier.parameters(), "lr_mult": 10.0},
    ]
    optimizer = torch.optim.SGD(params, lr=args.lr, momentum=0.9, weight_decay=args.weight_decay)

    train_set = SegFolder(args.data_root, "train", args.crop, train=True)
    val_set = SegFolder(args.data_root, "val", args.crop, train=False)
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    # strided shard without padding, so no image is counted twice in the confusion matrix
    val_shard = Subset(val_set, range(rank, len(val_set), world_size))
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=6, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_shard, batch_size=1, shuffle=False, num_workers=4)

    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)
        print(f"{world_size} GPUs, {args.batch_size} img/GPU, {len(train_loader)} iters/epoch")

    it, epoch, best_miou = 0, 0, 0.0
    t0 = time.time()
    while it < args.iters:
        train_sampler.set_epoch(epoch)
        for img, mask in train_loader:
            if it >= args.iters:
                break
            poly_lr(optimizer, args.lr, it, args.iters)
            img, mask = img.to(device, non_blocking=True), mask.to(device, non_blocking=True)
            out = model(img)
            loss = F.cross_entropy(out["out"], mask, ignore_index=255)
            loss = loss + args.aux_weight * F.cross_entropy(out["aux"], mask, ignore_index=255)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            it += 1

            if it % 50 == 0:
                l = loss.detach().clone()
                dist.all_reduce(l)
                if rank == 0:
                    print(f"it {it}/{args.iters} loss {l.item() / world_size:.4f} "
                          f"lr {optimizer.param_groups[0]['lr']:.5f} {time.time() - t0:.0f}s")
            if it % args.eval_every == 0 or it == args.iters:
                miou = evaluate(model, val_loader, args.num_classes, device)
                if rank == 0:
                    print(f"it {it}: mIoU {100 * miou:.2f}")
                    ckpt = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "iter": it}
                    torch.save(ckpt, os.path.join(args.save_dir, "latest.pth"))
                    if miou > best_miou:
                        best_miou = miou
                        torch.save(ckpt, os.path.join(args.save_dir, "best.pth"))
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
