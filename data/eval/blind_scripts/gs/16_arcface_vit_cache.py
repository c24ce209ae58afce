"""ViT-S ArcFace on a folder-per-identity dump, AdamW + Partial FC, gradient accumulation.

    torchrun --nproc_per_node=8 train_vit_folders.py --root /data/faces/aligned --accum 2
"""
import argparse
import contextlib
import json
import logging
import os
import time

import torch
import torch.distributed as dist
import wandb
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms

from backbones import get_model
from losses import CombinedMarginLoss
from partial_fc_v2 import PartialFC_V2
from utils.utils_callbacks import CallBackVerification

logger = logging.getLogger("vit-arcface")


def scan_folders(root):
    identities = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)))
    samples = []
    for label, name in enumerate(identities):
        for fname in sorted(os.listdir(os.path.join(root, name))):
            if fname.lower().endswith((".jpg", ".png")):
                samples.append((f"{name}/{fname}", label))
    return {"num_classes": len(identities), "samples": samples}


def load_or_build_index(root, cache, rank):
    # one process walks the tree, the others wait and read the finished file
    if rank == 0 and not os.path.exists(cache):
        index = scan_folders(root)
        tmp = cache + ".tmp"
        with open(tmp, "w") as f:
            json.dump(index, f)
        os.replace(tmp, cache)
    dist.barrier()
    with open(cache) as f:
        return json.load(f)


class FolderFaces(Dataset):
    def __init__(self, root, samples):
        self.root = root
        self.samples = samples
        self.tf = transforms.Compose([
            transforms.RandomHorizontalFlip(),
            transforms.ToTensor(),
            transforms.Normalize([0.5] * 3, [0.5] * 3),
        ])

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        rel, label = self.samples[i]
        return self.tf(Image.open(os.path.join(self.root, rel)).convert("RGB")), label


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--index-cache", default="")
    ap.add_argument("--val-prefix", default="/data/faces/val_bins")
    ap.add_argument("--output", default="work_dirs/vit_s_folders")
    ap.add_argument("--network", default="vit_s")
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--accum", type=int, default=1)
    ap.add_argument("--lr", type=float, default=1e-3, help="AdamW lr for a global batch of 2048")
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--warmup-epochs", type=int, default=4)
    ap.add_argument("--sample-rate", type=float, default=0.3)
    ap.add_argument("--wandb-project", default="")
    return ap.parse_args()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s %(message)s")
    os.makedirs(args.output, exist_ok=True)

    run = None
    if rank == 0 and args.wandb_project:
        run = wandb.init(project=args.wandb_project, config=vars(args), dir=args.output)

    cache = args.index_cache or os.path.join(args.output, "index.json")
    index = load_or_build_index(args.root, cache, rank)
    dataset = FolderFaces(args.root, index["samples"])
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, num_workers=8,
                        pin_memory=True, drop_last=True, persistent_workers=True)

    backbone = get_model(args.network, dropout=0.0, fp16=True, num_features=512).to(device)
    backbone = DDP(backbone, device_ids=[local_rank], broadcast_buffers=False, bucket_cap_mb=32)
    pfc = PartialFC_V2(CombinedMarginLoss(64, 1.0, 0.5, 0.0), 512, index["num_classes"], args.sample_rate, True)
    pfc.train().to(device)

    global_batch = args.batch_size * world_size * args.accum
    opt = torch.optim.AdamW([{"params": backbone.parameters()}, {"params": pfc.parameters()}],
                            lr=args.lr * global_batch / 2048, weight_decay=args.weight_decay)
    updates_per_epoch = len(loader) // args.accum
    warmup = updates_per_epoch * args.warmup_epochs
    total = updates_per_epoch * args.epochs
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda i: (i + 1) / warmup if i < warmup else max(0.0, 1 - (i - warmup) / (total - warmup)) ** 2)
    scaler = torch.cuda.amp.GradScaler(growth_interval=100)
    verifier = CallBackVerification(val_targets=["lfw", "cfp_fp", "agedb_30"], rec_prefix=args.val_prefix)

    update = 0
    tic = time.time()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        opt.zero_grad(set_to_none=True)
        for i, (img, label) in enumerate(loader):
            img = img.to(device, non_blocking=True)
            label = label.to(device, non_blocking=True)
            boundary = (i + 1) % args.accum == 0
            # skip the gradient all-reduce of the backbone on the intermediate micro-batches
            with contextlib.nullcontext() if boundary else backbone.no_sync():
                loss = pfc(backbone(img), label)
                scaler.scale(loss / args.accum).backward()
            if not boundary:
                continue

            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(backbone.parameters(), 5)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            sched.step()
            update += 1

            if rank == 0 and update % 50 == 0:
                lr = sched.get_last_lr()[0]
                speed = 50 * global_batch / (time.time() - tic)
                tic = time.time()
                logger.info("epoch %d update %d/%d loss %.4f lr %.6f %.0f img/s", epoch, update, total,
                            loss.item(), lr, speed)
                if run is not None:
                    run.log({"loss": loss.item(), "lr": lr, "speed": speed, "epoch": epoch}, step=update)
            if update % 2000 == 0:
                verifier(update, backbone)

        torch.save(pfc.state_dict(), os.path.join(args.output, f"softmax_fc_gpu_{rank}.pt"))
        if rank == 0:
            torch.save(backbone.module.state_dict(), os.path.join(args.output, "model.pt"))
        dist.barrier()

    if run is not None:
        run.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
