"""Contrastive image-text training from WebDataset tar shards (LAION subset).

torchrun --nproc_per_node=8 train_clip_wds.py \
    --train-shards "/data/laion400m-sub/{00000..01023}.tar" --train-num-samples 9000000 \
    --val-csv /data/coco/val2017_captions.csv --model ViT-B-32
"""
import argparse
import logging
import math
import os
import time

import open_clip
import pandas as pd
import torch
import torch.distributed as dist
import torch.distributed.nn
import torch.nn.functional as F
import webdataset as wds
from braceexpand import braceexpand
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset

logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
log = logging.getLogger("clip")


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train-shards", required=True)
    p.add_argument("--train-num-samples", type=int, required=True)
    p.add_argument("--val-csv", required=True)
    p.add_argument("--model", default="ViT-B-32")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--epochs", type=int, default=16)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--wd", type=float, default=0.2)
    p.add_argument("--warmup", type=int, default=2000)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--logs", default="logs/clip_wds")
    return p.parse_args()


def make_train_loader(args, preprocess, tokenizer):
    urls = list(braceexpand(args.train_shards))
    pipeline = (
        wds.WebDataset(urls, shardshuffle=True, nodesplitter=wds.split_by_node, handler=wds.warn_and_continue)
        .shuffle(5000)
        .decode("pilrgb", handler=wds.warn_and_continue)
        .rename(image="jpg;png;webp", text="txt")
        .map_dict(image=preprocess, text=lambda t: tokenizer([t])[0])
        .to_tuple("image", "text")
        .batched(args.batch_size, partial=False)
    )
    return wds.WebLoader(pipeline, batch_size=None, shuffle=False, num_workers=args.workers,
                         persistent_workers=True)


class CsvPairs(Dataset):
    def __init__(self, path, preprocess, tokenizer):
        self.df = pd.read_csv(path)
        self.pre, self.tok = preprocess, tokenizer

    def __len__(self):
        return len(self.df)

    def __getitem__(self, i):
        r = self.df.iloc[i]
        return self.pre(Image.open(r["filepath"]).convert("RGB")), self.tok([r["caption"]])[0]


def contrastive_loss(img, txt, logit_scale, rank):
    all_img = torch.cat(torch.distributed.nn.functional.all_gather(img))
    all_txt = torch.cat(torch.distributed.nn.functional.all_gather(txt))
    labels = torch.arange(img.shape[0], device=img.device) + rank * img.shape[0]
    li = logit_scale * img @ all_txt.T
    lt = logit_scale * txt @ all_img.T
    return (F.cross_entropy(li, labels) + F.cross_entropy(lt, labels)) / 2


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    s = torch.zeros(3, device=device)
    for images, texts in loader:
        images, texts = images.to(device), texts.to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            img = F.normalize(model.encode_image(images).float(), dim=-1)
            txt = F.normalize(model.encode_text(texts).float(), dim=-1)
        sim = img @ txt.T
        target = torch.arange(len(img), device=device)
        s[0] += (sim.argmax(1) == target).sum()
        s[1] += (sim.argmax(0) == target).sum()
        s[2] += len(img)
    dist.all_reduce(s)
    model.train()
    return (s[0] / s[2]).item(), (s[1] / s[2]).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    model, preprocess_train, preprocess_val = open_clip.create_model_and_transforms(args.model, pretrained=None)
    tokenizer = open_clip.get_tokenizer(args.model)
    model = model.to(device)
    ddp_model = DDP(model, device_ids=[local_rank])

    train_loader = make_train_loader(args, preprocess_train, tokenizer)
    val_ds = CsvPairs(args.val_csv, preprocess_val, tokenizer)
    val_loader = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), batch_size=100, num_workers=4)

    global_batch = args.batch_size * world
    steps_per_epoch = args.train_num_samples // global_batch
    total_steps = steps_per_epoch * args.epochs

    exclude = lambda n, p: p.ndim < 2 or "bn" in n or "ln" in n or "bias" in n or "logit_scale" in n
    named = list(model.named_parameters())
    opt = torch.optim.AdamW([
        {"params": [p for n, p in named if exclude(n, p) and p.requires_grad], "weight_decay": 0.0},
        {"params": [p for n, p in named if not exclude(n, p) and p.requires_grad], "weight_decay": args.wd},
    ], lr=args.lr, betas=(0.9, 0.98), eps=1e-6)
    scaler = torch.cuda.amp.GradScaler()

    def lr_at(step):
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        return 0.5 * args.lr * (1 + math.cos(math.pi * (step - args.warmup) / (total_steps - args.warmup)))

    if rank == 0:
        os.makedirs(args.logs, exist_ok=True)
        log.info(f"world {world} global batch {global_batch} steps/epoch {steps_per_epoch}")

    step = 0
    for epoch in range(args.epochs):
        t0 = time.time()
        for i, (images, texts) in enumerate(train_loader):
            for g in opt.param_groups:
                g["lr"] = lr_at(step)
            images = images.to(device, non_blocking=True)
            texts = texts.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                img, txt, logit_scale = ddp_model(images, texts)
                loss = contrastive_loss(img, txt, logit_scale, rank)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            with torch.no_grad():
                model.logit_scale.clamp_(0, math.log(100))
            step += 1

            if i % 100 == 0:
                l = loss.detach().clone()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    sps = (i + 1) * global_batch / (time.time() - t0)
                    log.info(f"epoch {epoch} step {i}/{steps_per_epoch} loss {l.item():.4f} "
                             f"scale {logit_scale.item():.2f} lr {lr_at(step):.2e} {sps:.0f} samples/s")

        i2t, t2i = evaluate(model, val_loader, device)
        if rank == 0:
            log.info(f"epoch {epoch} val i2t@1 {i2t:.4f} t2i@1 {t2i:.4f}")
            torch.save({"epoch": epoch + 1, "state_dict": model.state_dict(), "optimizer": opt.state_dict(),
                        "scaler": scaler.state_dict(), "step": step},
                       os.path.join(args.logs, f"epoch_{epoch + 1}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
