"""Cityscapes semantic segmentation distillation for the in-car ECU.

teacher: DeepLabV3-ResNet101 (our fine-tuned checkpoint, frozen)
student: LR-ASPP MobileNetV3-Large
losses : CE on labels + pixel-wise KL on teacher logits (CWD-style channel
         temperature is left for later)

    torchrun --nnodes=1 --nproc_per_node=8 06_seg_kd_cityscapes.py \
        --root /data/cityscapes --teacher work_dirs/dlv3_r101_city/best.pth
"""
import argparse
import os
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision.datasets import Cityscapes
from torchvision.models.segmentation import deeplabv3_resnet101, lraspp_mobilenet_v3_large
from torchvision.models import MobileNet_V3_Large_Weights
import torchvision.transforms.functional as TF

NUM_CLASSES = 19
IGNORE = 255
MEAN = [0.485, 0.456, 0.406]
STD = [0.229, 0.224, 0.225]


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--teacher", required=True)
    p.add_argument("--crop", type=int, nargs=2, default=[512, 1024])
    p.add_argument("--batch-size", type=int, default=2, help="images per GPU")
    p.add_argument("--iters", type=int, default=80000)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--kd-T", type=float, default=1.0)
    p.add_argument("--kd-weight", type=float, default=3.0)
    p.add_argument("--eval-every", type=int, default=4000)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--work-dir", default="work_dirs/lraspp_kd_city")
    return p.parse_args()


class CityscapesTrainIds(Dataset):
    def __init__(self, root, split, crop=None, train=True):
        self.ds = Cityscapes(root, split=split, mode="fine", target_type="semantic")
        self.crop = crop
        self.train = train
        # id -> trainId lookup
        lut = np.full(256, IGNORE, dtype=np.uint8)
        for c in Cityscapes.classes:
            if 0 <= c.train_id < NUM_CLASSES:
                lut[c.id] = c.train_id
        self.lut = lut

    def __len__(self):
        return len(self.ds)

    def __getitem__(self, i):
        img, target = self.ds[i]
        target = torch.from_numpy(self.lut[np.array(target)]).long()
        img = TF.to_tensor(img)
        if self.train:
            scale = random.uniform(0.5, 2.0)
            h, w = int(img.shape[1] * scale), int(img.shape[2] * scale)
            img = TF.resize(img, [h, w], antialias=True)
            target = TF.resize(target[None], [h, w], interpolation=TF.InterpolationMode.NEAREST)[0]
            ch, cw = self.crop
            ph, pw = max(ch - h, 0), max(cw - w, 0)
            if ph or pw:
                img = F.pad(img, (0, pw, 0, ph), value=0.0)
                target = F.pad(target, (0, pw, 0, ph), value=IGNORE)
            y0 = random.randint(0, img.shape[1] - ch)
            x0 = random.randint(0, img.shape[2] - cw)
            img = img[:, y0:y0 + ch, x0:x0 + cw]
            target = target[y0:y0 + ch, x0:x0 + cw]
            if random.random() < 0.5:
                img, target = img.flip(-1), target.flip(-1)
        img = TF.normalize(img, MEAN, STD)
        return img, target


def infinite(loader, sampler):
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        for batch in loader:
            yield batch
        epoch += 1


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    hist = torch.zeros(NUM_CLASSES, NUM_CLASSES, device=device, dtype=torch.long)
    for img, target in loader:
        img, target = img.to(device), target.to(device)
        pred = model(img)["out"].argmax(1)
        k = target != IGNORE
        hist += torch.bincount(target[k] * NUM_CLASSES + pred[k],
                               minlength=NUM_CLASSES ** 2).view(NUM_CLASSES, NUM_CLASSES)
    dist.all_reduce(hist)
    iou = hist.diag().float() / (hist.sum(0) + hist.sum(1) - hist.diag()).float().clamp(min=1)
    return iou.mean().item() * 100


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    world = dist.get_world_size()
    device = torch.device("cuda", local_rank)
    seed = 42 + rank
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)

    train_set = CityscapesTrainIds(args.root, "train", crop=args.crop, train=True)
    val_set = CityscapesTrainIds(args.root, "val", train=False)
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(torch.utils.data.Subset(val_set, range(rank, len(val_set), world)),
                            batch_size=1, num_workers=2)

    teacher = deeplabv3_resnet101(weights=None, weights_backbone=None, num_classes=NUM_CLASSES, aux_loss=True)
    ckpt = torch.load(args.teacher, map_location="cpu")
    teacher.load_state_dict(ckpt["model"])
    teacher.to(device).eval().requires_grad_(False)

    student = lraspp_mobilenet_v3_large(weights=None, num_classes=NUM_CLASSES,
                                        weights_backbone=MobileNet_V3_Large_Weights.IMAGENET1K_V1)
    student.to(device)
    student = DDP(student, device_ids=[local_rank])

    optimizer = torch.optim.SGD(student.parameters(), lr=args.lr, momentum=0.9, weight_decay=4e-5)
    scheduler = torch.optim.lr_scheduler.PolynomialLR(optimizer, total_iters=args.iters, power=0.9)

    if rank == 0:
        os.makedirs(args.work_dir, exist_ok=True)
        print(f"global batch = {args.batch_size * world}", flush=True)

    best_miou = 0.0
    data_iter = infinite(train_loader, train_sampler)
    student.train()
    for it in range(1, args.iters + 1):
        img, target = next(data_iter)
        img = img.to(device, non_blocking=True)
        target = target.to(device, non_blocking=True)

        with torch.no_grad():
            t_logits = teacher(img)["out"]
        s_logits = student(img)["out"]

        ce = F.cross_entropy(s_logits, target, ignore_index=IGNORE)
        T = args.kd_T
        valid = (target != IGNORE).unsqueeze(1).float()
        kl = F.kl_div(F.log_softmax(s_logits / T, 1), F.softmax(t_logits / T, 1), reduction="none")
        kd = (kl * valid).sum() / valid.sum().clamp(min=1) * T * T
        loss = ce + args.kd_weight * kd

        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        scheduler.step()

        if rank == 0 and it % 50 == 0:
            print(f"it {it}/{args.iters} ce {ce.item():.4f} kd {kd.item():.4f} "
                  f"lr {scheduler.get_last_lr()[0]:.5f}", flush=True)

        if it % args.eval_every == 0 or it == args.iters:
            miou = evaluate(student.module, val_loader, device)
            student.train()
            if rank == 0:
                print(f"it {it}: mIoU {miou:.2f}", flush=True)
                torch.save({"model": student.module.state_dict(), "iter": it, "miou": miou},
                           os.path.join(args.work_dir, "latest.pth"))
                if miou > best_miou:
                    best_miou = miou
                    torch.save(student.module.state_dict(), os.path.join(args.work_dir, "best_student.pth"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
