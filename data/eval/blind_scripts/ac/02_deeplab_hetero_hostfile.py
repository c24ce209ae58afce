"""DeepLabV3-ResNet50 on Cityscapes over a mixed pool of lab machines.

The boxes do not all have the same number of GPUs, so there is no torchrun here:
every node reads the shared hostfile, works out where its ranks start, and
spawns one process per local GPU. Rendezvous goes through a file on the NFS share.

/nfs/jobs/seg42/hostfile:
    gpu-a100-01 slots=8
    gpu-a100-02 slots=8
    gpu-v100-07 slots=4

Launch (the same line on every node):
    pdsh -w gpu-a100-01,gpu-a100-02,gpu-v100-07 "cd /nfs/code/seg && \
        python train_seg_hetero.py --hostfile /nfs/jobs/seg42/hostfile --run-id seg42-r3 \
        --data /nfs/datasets/cityscapes.tar --out /nfs/jobs/seg42/out"
"""
import argparse
import os
import socket
import tarfile
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision.datasets import Cityscapes
from torchvision.models.segmentation import deeplabv3_resnet50
from torchvision.transforms import functional as TF

NUM_CLASSES = 19
IGNORE = 255
LOCAL_CACHE = "/scratch/local/cityscapes"


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--hostfile", required=True)
    p.add_argument("--run-id", required=True, help="fresh for every launch; names the rendezvous file")
    p.add_argument("--data", required=True, help="tarball with leftImg8bit/ and gtFine/")
    p.add_argument("--out", required=True)
    p.add_argument("--epochs", type=int, default=120)
    p.add_argument("--batch-size", type=int, default=4, help="per GPU")
    p.add_argument("--lr", type=float, default=0.02, help="for a global batch of 32, scaled linearly")
    p.add_argument("--crop", type=int, default=768)
    p.add_argument("--workers", type=int, default=6)
    p.add_argument("--port-dir", default="/nfs/jobs/rdzv")
    return p.parse_args()


def read_hostfile(path):
    hosts = []
    with open(path) as fh:
        for line in fh:
            line = line.split("#")[0].strip()
            if not line:
                continue
            name, slots = line.split()
            hosts.append((name, int(slots.split("=")[1])))
    return hosts


class JointTrain:
    def __init__(self, crop):
        self.crop = crop

    def __call__(self, img, target):
        scale = np.random.uniform(0.5, 2.0)
        w, h = img.size
        nw, nh = int(w * scale), int(h * scale)
        img = TF.resize(img, (nh, nw), interpolation=TF.InterpolationMode.BILINEAR)
        target = TF.resize(target, (nh, nw), interpolation=TF.InterpolationMode.NEAREST)
        pad_h, pad_w = max(self.crop - nh, 0), max(self.crop - nw, 0)
        if pad_h or pad_w:
            img = TF.pad(img, [0, 0, pad_w, pad_h], fill=0)
            target = TF.pad(target, [0, 0, pad_w, pad_h], fill=IGNORE)
        i = np.random.randint(0, img.size[1] - self.crop + 1)
        j = np.random.randint(0, img.size[0] - self.crop + 1)
        img = TF.crop(img, i, j, self.crop, self.crop)
        target = TF.crop(target, i, j, self.crop, self.crop)
        if np.random.rand() < 0.5:
            img, target = TF.hflip(img), TF.hflip(target)
        return _to_tensors(img, target)


def joint_eval(img, target):
    return _to_tensors(img, target)


def _to_tensors(img, target):
    img = TF.normalize(TF.to_tensor(img), [0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    target = torch.as_tensor(np.array(target), dtype=torch.long)
    return img, target


def stage_dataset(tar_path, dest):
    """Unpack the dataset once per node onto the local NVMe."""
    done = os.path.join(dest, ".complete")
    if os.path.exists(done):
        return
    os.makedirs(dest, exist_ok=True)
    with tarfile.open(tar_path) as tf:
        tf.extractall(dest)
    open(done, "w").close()


def confusion(pred, target, n):
    k = target != IGNORE
    return torch.bincount(n * target[k] + pred[k], minlength=n * n).reshape(n, n)


@torch.no_grad()
def evaluate(net, loader, device):
    net.eval()
    hist = torch.zeros(NUM_CLASSES, NUM_CLASSES, dtype=torch.long, device=device)
    for img, target in loader:
        img, target = img.to(device, non_blocking=True), target.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            out = net(img)["out"]
        hist += confusion(out.argmax(1), target, NUM_CLASSES)
    dist.all_reduce(hist)
    iou = hist.diag().float() / (hist.sum(0) + hist.sum(1) - hist.diag()).float().clamp(min=1)
    net.train()
    return iou.mean().item()


def worker(local_rank, rank_offset, world_size, args):
    rank = rank_offset + local_rank
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    dist.init_process_group(
        backend="nccl",
        init_method=f"file://{os.path.join(args.port_dir, args.run_id)}",
        rank=rank,
        world_size=world_size,
    )

    if local_rank == 0:
        stage_dataset(args.data, LOCAL_CACHE)
    dist.barrier()

    train_set = Cityscapes(LOCAL_CACHE, split="train", mode="fine", target_type="semantic",
                           transforms=JointTrain(args.crop))
    val_full = Cityscapes(LOCAL_CACHE, split="val", mode="fine", target_type="semantic",
                          transforms=joint_eval)
    # each rank scores a disjoint slice of val, no padding duplicates
    val_set = Subset(val_full, list(range(rank, len(val_full), world_size)))

    train_sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank,
                                       shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True,
                              persistent_workers=True)
    val_loader = DataLoader(val_set, batch_size=1, num_workers=2, pin_memory=True)

    model = deeplabv3_resnet50(weights=None, weights_backbone="IMAGENET1K_V2",
                               num_classes=NUM_CLASSES, aux_loss=True)
    model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    lr = args.lr * world_size * args.batch_size / 32
    params = [
        {"params": model.module.backbone.parameters(), "lr": lr},
        {"params": list(model.module.classifier.parameters()) + list(model.module.aux_classifier.parameters()),
         "lr": lr * 10},
    ]
    opt = torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=1e-4)
    iters = args.epochs * len(train_loader)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda it: (1 - it / iters) ** 0.9)
    scaler = torch.cuda.amp.GradScaler()

    os.makedirs(args.out, exist_ok=True)
    ckpt_path = os.path.join(args.out, "checkpoint.pth")
    start_epoch, best = 0, 0.0
    if os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, map_location="cpu")
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        scaler.load_state_dict(ck["scaler"])
        start_epoch, best = ck["epoch"] + 1, ck["best"]

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        for i, (img, target) in enumerate(train_loader):
            img = img.to(device, non_blocking=True)
            target = target.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                out = model(img)
                loss = F.cross_entropy(out["out"], target, ignore_index=IGNORE)
                loss = loss + 0.4 * F.cross_entropy(out["aux"], target, ignore_index=IGNORE)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            sched.step()
            if rank == 0 and i % 50 == 0:
                print(f"[{epoch}:{i}/{len(train_loader)}] loss {loss.item():.4f} "
                      f"lr {sched.get_last_lr()[0]:.5f}", flush=True)

        miou = evaluate(model.module, val_loader, device) if (epoch + 1) % 5 == 0 else -1.0
        if rank == 0:
            print(f"epoch {epoch} took {time.time() - t0:.0f}s  mIoU {miou:.4f}", flush=True)
            state = {"model": model.module.state_dict(), "opt": opt.state_dict(),
                     "sched": sched.state_dict(), "scaler": scaler.state_dict(),
                     "epoch": epoch, "best": max(best, miou)}
            torch.save(state, ckpt_path + ".tmp")
            os.replace(ckpt_path + ".tmp", ckpt_path)
            if miou > best:
                torch.save(model.module.state_dict(), os.path.join(args.out, "best.pth"))
        best = max(best, miou)
        dist.barrier()

    dist.destroy_process_group()


def main():
    args = parse_args()
    hosts = read_hostfile(args.hostfile)
    me = socket.gethostname().split(".")[0]
    names = [h for h, _ in hosts]
    if me not in names:
        raise SystemExit(f"{me} is not in {args.hostfile}")
    node_idx = names.index(me)
    nprocs = hosts[node_idx][1]
    rank_offset = sum(s for _, s in hosts[:node_idx])
    world_size = sum(s for _, s in hosts)
    if torch.cuda.device_count() < nprocs:
        raise SystemExit(f"{me}: hostfile says {nprocs} slots but only "
                         f"{torch.cuda.device_count()} GPUs are visible")
    print(f"{me}: node {node_idx}, ranks {rank_offset}..{rank_offset + nprocs - 1} of {world_size}",
          flush=True)
    mp.spawn(worker, args=(rank_offset, world_size, args), nprocs=nprocs, join=True)


if __name__ == "__main__":
    main()
