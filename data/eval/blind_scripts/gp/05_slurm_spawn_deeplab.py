"""DeepLabV3 semantic segmentation, one Slurm task per node + mp.spawn per GPU.

    sbatch --nodes=2 --ntasks-per-node=1 --gpus-per-node=4 --cpus-per-task=32 \
        --wrap "srun python seg_train.py --root /lustre/datasets/cityscapes --out /lustre/$USER/seg"

The inner part (init_distributed / train) is shared with our torchrun entry point,
so it reads the usual env:// variables.
"""
import argparse
import glob
import os
import subprocess
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision.models.segmentation import deeplabv3_resnet50

NUM_CLASSES = 19
IGNORE = 255
MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)
STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)


class CityscapesPairs(Dataset):
    def __init__(self, root, split, crop=768, train=True):
        self.images = sorted(glob.glob(os.path.join(root, "leftImg8bit", split, "*", "*_leftImg8bit.png")))
        self.crop, self.train = crop, train

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        img_path = self.images[i]
        lbl_path = img_path.replace("leftImg8bit", "gtFine", 1).replace("_leftImg8bit.png", "_gtFine_labelTrainIds.png")
        img = (np.asarray(Image.open(img_path).convert("RGB"), dtype=np.float32) / 255.0 - MEAN) / STD
        lbl = np.asarray(Image.open(lbl_path), dtype=np.int64)
        if self.train:
            h, w = lbl.shape
            y0 = np.random.randint(0, h - self.crop + 1)
            x0 = np.random.randint(0, w - self.crop + 1)
            img = img[y0:y0 + self.crop, x0:x0 + self.crop]
            lbl = lbl[y0:y0 + self.crop, x0:x0 + self.crop]
            if np.random.rand() < 0.5:
                img, lbl = img[:, ::-1], lbl[:, ::-1]
        img = torch.from_numpy(np.ascontiguousarray(img.transpose(2, 0, 1)))
        return img, torch.from_numpy(np.ascontiguousarray(lbl))


def init_distributed():
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", 0)))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", init_method="env://", rank=rank, world_size=world_size)
    return rank, world_size, local_rank


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    conf = torch.zeros(NUM_CLASSES, NUM_CLASSES, dtype=torch.int64, device=device)
    for img, lbl in loader:
        img, lbl = img.to(device, non_blocking=True), lbl.to(device, non_blocking=True)
        pred = model(img)["out"].argmax(1)
        keep = lbl != IGNORE
        idx = lbl[keep] * NUM_CLASSES + pred[keep]
        conf += torch.bincount(idx, minlength=NUM_CLASSES ** 2).view(NUM_CLASSES, NUM_CLASSES)
    dist.all_reduce(conf)
    iou = conf.diag().float() / (conf.sum(0) + conf.sum(1) - conf.diag()).float().clamp(min=1)
    model.train()
    return iou.mean().item()


def train(args):
    rank, world_size, local_rank = init_distributed()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    train_ds = CityscapesPairs(args.root, "train", crop=args.crop, train=True)
    val_ds = CityscapesPairs(args.root, "val", train=False)
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    val_idx = list(range(rank, len(val_ds), world_size))
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                          num_workers=6, pin_memory=True, drop_last=True)
    val_dl = DataLoader(torch.utils.data.Subset(val_ds, val_idx), batch_size=1, num_workers=4)

    model = deeplabv3_resnet50(weights=None, weights_backbone="IMAGENET1K_V2", num_classes=NUM_CLASSES,
                               aux_loss=True)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])

    params = [{"params": model.module.backbone.parameters(), "lr": args.lr},
              {"params": model.module.classifier.parameters(), "lr": args.lr * 10},
              {"params": model.module.aux_classifier.parameters(), "lr": args.lr * 10}]
    opt = torch.optim.SGD(params, lr=args.lr, momentum=0.9, weight_decay=1e-4)
    total = args.epochs * len(train_dl)
    sched = torch.optim.lr_scheduler.PolynomialLR(opt, total_iters=total, power=0.9)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"world_size={world_size}, {len(train_dl)} iters/epoch", flush=True)

    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        for it, (img, lbl) in enumerate(train_dl):
            img, lbl = img.to(device, non_blocking=True), lbl.to(device, non_blocking=True)
            out = model(img)
            loss = F.cross_entropy(out["out"], lbl, ignore_index=IGNORE) \
                + 0.4 * F.cross_entropy(out["aux"], lbl, ignore_index=IGNORE)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            if rank == 0 and it % 20 == 0:
                print(f"ep {epoch} it {it} loss {loss.item():.4f}", flush=True)

        if (epoch + 1) % args.eval_every == 0 or epoch + 1 == args.epochs:
            miou = evaluate(model.module, val_dl, device)
            if rank == 0:
                print(f"epoch {epoch} mIoU {miou * 100:.2f} ({time.time() - t0:.0f}s)", flush=True)
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "miou": miou},
                           os.path.join(args.out, "last.pth"))
                if miou > best:
                    best = miou
                    torch.save(model.module.state_dict(), os.path.join(args.out, "best.pth"))
            dist.barrier()

    dist.destroy_process_group()


def spawn_worker(local_rank, args, node_rank, nnodes, gpus_per_node, master_addr, master_port):
    os.environ["MASTER_ADDR"] = master_addr
    os.environ["MASTER_PORT"] = str(master_port)
    os.environ["WORLD_SIZE"] = str(nnodes * gpus_per_node)
    os.environ["RANK"] = str(node_rank * gpus_per_node + local_rank)
    train(args)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--epochs", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=2, help="images per GPU")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--crop", type=int, default=768)
    p.add_argument("--eval-every", type=int, default=10)
    args = p.parse_args()

    nnodes = int(os.environ["SLURM_NNODES"])
    node_rank = int(os.environ["SLURM_NODEID"])
    gpus_per_node = torch.cuda.device_count()
    hosts = subprocess.run(["scontrol", "show", "hostnames", os.environ["SLURM_JOB_NODELIST"]],
                           capture_output=True, text=True, check=True).stdout.split()
    master_port = 15000 + int(os.environ["SLURM_JOB_ID"]) % 20000
    mp.spawn(spawn_worker, args=(args, node_rank, nnodes, gpus_per_node, hosts[0], master_port),
             nprocs=gpus_per_node, join=True)


if __name__ == "__main__":
    main()
