"""CLIP training on LAION subset with ImageNet zero-shot eval every N epochs.

    torchrun --nproc_per_node=8 07_openclip_imagenet_zeroshot.py \
        --train-data /data/laion400m_subset/train.csv --imagenet-val /data/imagenet/val \
        --model ViT-B-16 --batch-size 256 --epochs 32
"""
import argparse
import logging
import math
import os

import open_clip
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn.functional as F
from open_clip.zero_shot_metadata import IMAGENET_CLASSNAMES, OPENAI_IMAGENET_TEMPLATES
from PIL import Image
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision.datasets import ImageFolder

log = logging.getLogger(__name__)


class PairCsv(Dataset):
    def __init__(self, path, transform, tokenize):
        df = pd.read_csv(path)
        self.paths, self.caps = df["filepath"].tolist(), df["caption"].tolist()
        self.transform, self.tokenize = transform, tokenize

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        return self.transform(Image.open(self.paths[i]).convert("RGB")), self.tokenize([str(self.caps[i])])[0]


class ContrastiveLoss(torch.nn.Module):
    """InfoNCE over the global batch.  Features of other ranks are gathered
    without grad; the local slice is put back so gradients flow to this rank's
    features."""

    def __init__(self, rank, world_size):
        super().__init__()
        self.rank, self.world_size = rank, world_size
        self._labels = {}

    def gather(self, x):
        parts = [torch.zeros_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x)
        parts[self.rank] = x
        return torch.cat(parts, 0)

    def forward(self, img, txt, logit_scale):
        all_img, all_txt = self.gather(img), self.gather(txt)
        logits_i = logit_scale * img @ all_txt.T
        logits_t = logit_scale * txt @ all_img.T
        n = img.shape[0]
        key = (n, img.device)
        if key not in self._labels:
            self._labels[key] = torch.arange(n, device=img.device) + n * self.rank
        labels = self._labels[key]
        return 0.5 * (F.cross_entropy(logits_i, labels) + F.cross_entropy(logits_t, labels))


@torch.no_grad()
def build_zeroshot_classifier(model, tokenizer, device):
    weights = []
    for name in IMAGENET_CLASSNAMES:
        texts = tokenizer([t(name) for t in OPENAI_IMAGENET_TEMPLATES]).to(device)
        emb = F.normalize(model.encode_text(texts), dim=-1).mean(0)
        weights.append(F.normalize(emb, dim=0))
    return torch.stack(weights, dim=1)


@torch.no_grad()
def zero_shot_eval(model, tokenizer, loader, device="cuda:0"):
    raw = model.module
    raw.eval()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        classifier = build_zeroshot_classifier(raw, tokenizer, device)
    correct = torch.zeros(2, device=device)
    for images, target in loader:
        images, target = images.to(device), target.to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            feats = F.normalize(raw.encode_image(images), dim=-1)
            logits = 100.0 * feats @ classifier
        top5 = logits.topk(5, dim=1).indices
        correct[0] += (top5[:, 0] == target).sum()
        correct[1] += (top5 == target[:, None]).any(1).sum()
    stats = torch.cat([correct, torch.tensor([len(loader.sampler)], device=device, dtype=correct.dtype)])
    dist.all_reduce(stats)
    raw.train()
    return (stats[0] / stats[2]).item(), (stats[1] / stats[2]).item()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--train-data", required=True)
    p.add_argument("--imagenet-val", required=True)
    p.add_argument("--model", default="ViT-B-16")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--epochs", type=int, default=32)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--wd", type=float, default=0.2)
    p.add_argument("--warmup", type=int, default=2000)
    p.add_argument("--zeroshot-frequency", type=int, default=2)
    p.add_argument("--logs", default="./logs/clip_b16")
    args = p.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR,
                        format=f"[rank{rank}] %(asctime)s %(message)s")

    model, train_tf, val_tf = open_clip.create_model_and_transforms(args.model, pretrained=None)
    tokenizer = open_clip.get_tokenizer(args.model)
    model.to(device)
    ddp_model = DistributedDataParallel(model, device_ids=[local_rank])
    criterion = ContrastiveLoss(rank, world_size)

    train_ds = PairCsv(args.train_data, train_tf, tokenizer)
    sampler = DistributedSampler(train_ds, shuffle=True)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=12,
                        pin_memory=True, drop_last=True, persistent_workers=True)
    in_val = ImageFolder(args.imagenet_val, transform=val_tf)
    in_loader = DataLoader(in_val, batch_size=256, num_workers=8,
                           sampler=DistributedSampler(in_val, shuffle=False, drop_last=True))

    exclude = lambda n, p: p.ndim < 2 or "bn" in n or "ln" in n or "bias" in n or "logit_scale" in n
    named = list(ddp_model.named_parameters())
    optimizer = torch.optim.AdamW([
        {"params": [p for n, p in named if exclude(n, p) and p.requires_grad], "weight_decay": 0.0},
        {"params": [p for n, p in named if not exclude(n, p) and p.requires_grad], "weight_decay": args.wd},
    ], lr=args.lr, betas=(0.9, 0.98), eps=1e-6)
    total_steps = len(loader) * args.epochs
    sched = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: (s + 1) / args.warmup if s < args.warmup
        else 0.5 * (1 + math.cos(math.pi * (s - args.warmup) / (total_steps - args.warmup))))
    scaler = torch.cuda.amp.GradScaler()

    if rank == 0:
        os.makedirs(os.path.join(args.logs, "checkpoints"), exist_ok=True)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        ddp_model.train()
        for i, (images, texts) in enumerate(loader):
            images, texts = images.to(device, non_blocking=True), texts.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                img_f, txt_f, scale = ddp_model(images, texts)
                loss = criterion(img_f, txt_f, scale)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            sched.step()
            with torch.no_grad():
                model.logit_scale.clamp_(0, math.log(100))
            if i % 200 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                log.info("epoch %d %d/%d loss %.4f scale %.1f", epoch, i, len(loader), l.item(), scale.item())

        if (epoch + 1) % args.zeroshot_frequency == 0 or epoch + 1 == args.epochs:
            top1, top5 = zero_shot_eval(ddp_model, tokenizer, in_loader)
            log.info("epoch %d imagenet zero-shot top1 %.2f top5 %.2f", epoch, 100 * top1, 100 * top5)

        if rank == 0:
            torch.save({"epoch": epoch + 1, "state_dict": model.state_dict(),
                        "optimizer": optimizer.state_dict(), "scaler": scaler.state_dict()},
                       os.path.join(args.logs, "checkpoints", "epoch_latest.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
