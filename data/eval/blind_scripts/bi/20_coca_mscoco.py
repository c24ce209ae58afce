"""CoCa (contrastive + captioning) fine-tuning on MSCOCO captions with OpenCLIP.

    torchrun --nproc_per_node 8 20_coca_mscoco.py --train-csv /data/coco/train2017_captions.csv \
        --root /data/coco --resume /shared/coca_ft/latest.pt
"""
import argparse
import logging
import math
import os
import time

import pandas as pd
import torch
import torch.distributed as dist
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

import open_clip
from open_clip.loss import CoCaLoss


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train-csv", required=True, help="columns: filepath,caption")
    p.add_argument("--root", required=True)
    p.add_argument("--model", default="coca_ViT-L-14")
    p.add_argument("--pretrained", default="laion2b_s13b_b90k")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--wd", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=1000)
    p.add_argument("--coca-caption-weight", type=float, default=2.0)
    p.add_argument("--coca-contrastive-weight", type=float, default=1.0)
    p.add_argument("--workers", type=int, default=6)
    p.add_argument("--out", default="/shared/coca_ft")
    p.add_argument("--resume", default=None)
    p.add_argument("--save-every", type=int, default=2000, help="steps")
    return p.parse_args()


class CocoCsv(Dataset):
    def __init__(self, csv, root, transform, tokenizer):
        df = pd.read_csv(csv)
        self.files = df["filepath"].tolist()
        self.caps = df["caption"].astype(str).tolist()
        self.root, self.transform, self.tokenizer = root, transform, tokenizer

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        img = Image.open(os.path.join(self.root, self.files[i])).convert("RGB")
        return self.transform(img), self.tokenizer([self.caps[i]])[0]


def cosine_with_warmup(step, warmup, total):
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR,
                        format="%(asctime)s %(message)s")
    log = logging.getLogger("coca")
    torch.manual_seed(0)

    model, train_tf, _ = open_clip.create_model_and_transforms(args.model, pretrained=args.pretrained)
    tokenizer = open_clip.get_tokenizer(args.model)
    model.to(device)

    dataset = CocoCsv(args.train_csv, args.root, train_tf, tokenizer)
    sampler = DistributedSampler(dataset, shuffle=True, drop_last=True)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True, persistent_workers=True)
    steps_per_epoch = len(loader)
    total = args.epochs * steps_per_epoch

    params_wd = [p for n, p in model.named_parameters() if p.ndim >= 2 and "logit_scale" not in n]
    params_no_wd = [p for n, p in model.named_parameters() if p.ndim < 2 or "logit_scale" in n]
    optimizer = torch.optim.AdamW([{"params": params_wd, "weight_decay": args.wd},
                                   {"params": params_no_wd, "weight_decay": 0.0}],
                                  lr=args.lr, betas=(0.9, 0.98), eps=1e-6)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer,
                                                  lambda s: cosine_with_warmup(s, args.warmup, total))
    scaler = torch.cuda.amp.GradScaler()

    step = 0
    if args.resume and os.path.exists(args.resume):
        ckpt = torch.load(args.resume, map_location="cpu")
        model.load_state_dict(ckpt["state_dict"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        scaler.load_state_dict(ckpt["scaler"])
        step = ckpt["step"]
        log.info("resumed from %s (step %d)", args.resume, step)

    model = DDP(model, device_ids=[local_rank])
    criterion = CoCaLoss(caption_loss_weight=args.coca_caption_weight,
                         clip_loss_weight=args.coca_contrastive_weight,
                         pad_id=0, local_loss=True, gather_with_grad=True,
                         rank=rank, world_size=world)

    def save(tag):
        if rank != 0:
            return
        os.makedirs(args.out, exist_ok=True)
        state = {"state_dict": model.state_dict(), "optimizer": optimizer.state_dict(),
                 "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(), "step": step}
        tmp = os.path.join(args.out, f".{tag}.tmp")
        torch.save(state, tmp)
        os.replace(tmp, os.path.join(args.out, f"{tag}.pt"))

    start_epoch, skip = divmod(step, steps_per_epoch)
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for i, (images, texts) in enumerate(loader):
            if epoch == start_epoch and i < skip:
                continue  # fast-forward inside a resumed epoch (same on every rank)
            images = images.to(device, non_blocking=True)
            texts = texts.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                out = model(images, texts)
                losses = criterion(**out, output_dict=True)
                loss = sum(losses.values())
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            with torch.no_grad():
                model.module.logit_scale.clamp_(0, math.log(100))
            step += 1
            if i % 50 == 0:
                log.info("epoch %d [%d/%d] %s lr %.2e %.2fs/it", epoch, i, steps_per_epoch,
                         " ".join(f"{k}={v.item():.4f}" for k, v in losses.items()),
                         scheduler.get_last_lr()[0], (time.time() - t0) / (i + 1))
            if step % args.save_every == 0:
                save("latest")
        save("latest")
        save(f"epoch_{epoch + 1}")
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
