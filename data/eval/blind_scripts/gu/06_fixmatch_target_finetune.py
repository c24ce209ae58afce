"""Source-free target fine-tuning with FixMatch-style consistency (DomainNet).

A model trained on the source domain is fine-tuned on unlabelled target images:
the prediction on a weakly augmented view becomes the pseudo-label for a strongly
augmented view when it is confident enough.

    torchrun --nproc_per_node=8 06_fixmatch_target_finetune.py \
        --data-root /datasets/domainnet --target sketch --source-ckpt ckpt/real_r50.pth
"""
import argparse
import logging
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torchvision
from PIL import Image
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms as T

logger = logging.getLogger(__name__)
NUM_CLASSES = 345


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data-root", required=True)
    parser.add_argument("--target", default="sketch")
    parser.add_argument("--source-ckpt", required=True)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=48)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--weight-decay", type=float, default=1e-4)
    parser.add_argument("--threshold", type=float, default=0.9)
    parser.add_argument("--num-workers", type=int, default=8)
    parser.add_argument("--output-dir", default="output/fixmatch_sfda")
    parser.add_argument("--log-interval", type=int, default=50)
    return parser.parse_args()


def read_split(root, domain, split):
    with open(os.path.join(root, f"{domain}_{split}.txt")) as f:
        return [(os.path.join(root, p), int(y)) for p, y in (line.split() for line in f)]


class TwoViewDataset(Dataset):
    def __init__(self, samples, weak, strong):
        self.samples, self.weak, self.strong = samples, weak, strong

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        img = Image.open(self.samples[i][0]).convert("RGB")
        return self.weak(img), self.strong(img)


class EvalDataset(Dataset):
    def __init__(self, samples, tf):
        self.samples, self.tf = samples, tf

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        path, y = self.samples[i]
        return self.tf(Image.open(path).convert("RGB")), y


def build_transforms():
    norm = T.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
    weak = T.Compose([T.RandomResizedCrop(224, scale=(0.6, 1.0)), T.RandomHorizontalFlip(), T.ToTensor(), norm])
    strong = T.Compose([T.RandomResizedCrop(224, scale=(0.3, 1.0)), T.RandomHorizontalFlip(),
                        T.RandAugment(num_ops=2, magnitude=10), T.ToTensor(), norm,
                        T.RandomErasing(p=0.5)])
    test = T.Compose([T.Resize(256), T.CenterCrop(224), T.ToTensor(), norm])
    return weak, strong, test


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    hits = torch.zeros(2, dtype=torch.float64, device=device)
    for images, targets in loader:
        images, targets = images.to(device, non_blocking=True), targets.to(device, non_blocking=True)
        preds = model(images).argmax(dim=1)
        hits[0] += (preds == targets).sum()
        hits[1] += targets.numel()
    dist.all_reduce(hits)
    model.train()
    return (hits[0] / hits[1]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device("cuda", local_rank)

    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"[rank{rank}] %(asctime)s %(message)s")

    weak_tf, strong_tf, test_tf = build_transforms()
    train_set = TwoViewDataset(read_split(args.data_root, args.target, "train"), weak_tf, strong_tf)
    test_set = EvalDataset(read_split(args.data_root, args.target, "test"), test_tf)
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.num_workers, pin_memory=True, drop_last=True)
    test_loader = DataLoader(test_set, batch_size=128, sampler=DistributedSampler(test_set, shuffle=False),
                             num_workers=args.num_workers, pin_memory=True)

    model = torchvision.models.resnet50(num_classes=NUM_CLASSES)
    ckpt = torch.load(args.source_ckpt, map_location="cpu")
    model.load_state_dict(ckpt["state_dict"] if "state_dict" in ckpt else ckpt)
    model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DistributedDataParallel(model, device_ids=[local_rank], output_device=local_rank)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    total_steps = args.epochs * len(train_loader)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=total_steps,
                                                    pct_start=0.05)

    acc0 = evaluate(model, test_loader, device)
    logger.info("source model on %s: %.2f%%", args.target, 100 * acc0)
    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)

    best = acc0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        start = time.time()
        meter = torch.zeros(3, device=device)  # loss sum, mask sum, steps
        for step, (weak, strong) in enumerate(train_loader):
            weak = weak.to(device, non_blocking=True)
            strong = strong.to(device, non_blocking=True)
            logits = model(torch.cat([weak, strong]))
            logits_w, logits_s = logits.chunk(2)

            probs = torch.softmax(logits_w.detach(), dim=1)
            max_probs, pseudo = probs.max(dim=1)
            mask = max_probs.ge(args.threshold)
            if mask.sum() == 0:
                scheduler.step()
                continue
            loss = F.cross_entropy(logits_s[mask], pseudo[mask])

            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()

            meter += torch.stack([loss.detach(), mask.float().mean(), torch.ones((), device=device)])
            if step % args.log_interval == 0:
                logger.info("epoch %d step %d/%d loss %.4f mask %.3f lr %.2e", epoch, step,
                            len(train_loader), loss.item(), mask.float().mean().item(),
                            scheduler.get_last_lr()[0])

        dist.all_reduce(meter)
        acc = evaluate(model, test_loader, device)
        logger.info("epoch %d: avg loss %.4f, avg mask %.3f, target acc %.2f%% (%.0fs)", epoch,
                    (meter[0] / meter[2].clamp(min=1)).item(), (meter[1] / meter[2].clamp(min=1)).item(),
                    100 * acc, time.time() - start)
        if rank == 0:
            state = {"epoch": epoch, "state_dict": model.module.state_dict(), "acc": acc,
                     "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}
            torch.save(state, os.path.join(args.output_dir, "checkpoint.pth"))
            if acc > best:
                best = acc
                torch.save(state, os.path.join(args.output_dir, "best.pth"))
        dist.barrier()

    logger.info("best target acc %.2f%%", 100 * best)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
