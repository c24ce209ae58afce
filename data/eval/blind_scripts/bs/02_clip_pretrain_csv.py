"""Contrastive image-text pretraining (CLIP) on a CSV of (filepath, caption) pairs.

Features are gathered across all ranks so the contrastive loss sees the
global batch.  Retrieval recall on a held-out CSV is computed every epoch.

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d \
        --rdzv_endpoint=$MASTER_ADDR:29500 02_clip_pretrain_csv.py --config configs/vitb32_cc12m.yaml
"""
import argparse
import math
import os
import time

import open_clip
import pandas as pd
import torch
import torch.distributed as dist
import torch.distributed.nn
import torch.nn.functional as F
import yaml
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class CsvDataset(Dataset):
    def __init__(self, csv_path, transform, tokenizer, img_key="filepath", cap_key="title"):
        df = pd.read_csv(csv_path, sep="\t")
        self.images = df[img_key].tolist()
        self.captions = df[cap_key].tolist()
        self.transform = transform
        self.tokenizer = tokenizer

    def __len__(self):
        return len(self.captions)

    def __getitem__(self, idx):
        image = self.transform(Image.open(self.images[idx]).convert("RGB"))
        text = self.tokenizer([str(self.captions[idx])])[0]
        return image, text, idx


def gather_features(image_features, text_features):
    # torch.distributed.nn.all_gather keeps the autograd graph, so every rank
    # gets gradients for its own features from all rank's logits
    all_image = torch.cat(torch.distributed.nn.all_gather(image_features), dim=0)
    all_text = torch.cat(torch.distributed.nn.all_gather(text_features), dim=0)
    return all_image, all_text


def clip_loss(image_features, text_features, logit_scale, rank):
    all_image, all_text = gather_features(image_features, text_features)
    logits_per_image = logit_scale * image_features @ all_text.t()
    logits_per_text = logit_scale * text_features @ all_image.t()
    n = image_features.shape[0]
    labels = torch.arange(n, device=image_features.device) + n * rank
    return (F.cross_entropy(logits_per_image, labels) + F.cross_entropy(logits_per_text, labels)) / 2


def cosine_lr(optimizer, base_lr, warmup, total):
    def _step(step):
        if step < warmup:
            lr = base_lr * (step + 1) / warmup
        else:
            e = step - warmup
            lr = 0.5 * (1 + math.cos(math.pi * e / max(1, total - warmup))) * base_lr
        for g in optimizer.param_groups:
            g["lr"] = lr
        return lr
    return _step


@torch.no_grad()
def retrieval_eval(model, loader, world_size):
    model.eval()
    feats_i, feats_t, idxs = [], [], []
    for images, texts, idx in loader:
        images, texts = images.cuda(non_blocking=True), texts.cuda(non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            fi = model.module.encode_image(images, normalize=True)
            ft = model.module.encode_text(texts, normalize=True)
        feats_i.append(fi.float())
        feats_t.append(ft.float())
        idxs.append(idx.cuda())
    feats_i, feats_t, idxs = torch.cat(feats_i), torch.cat(feats_t), torch.cat(idxs)

    def _gather(x):
        out = [torch.empty_like(x) for _ in range(world_size)]
        dist.all_gather(out, x)
        return torch.cat(out)

    # every rank has the same number of eval samples (DistributedSampler pads),
    # so the shapes match; padded duplicates are removed by index below
    feats_i, feats_t, idxs = _gather(feats_i), _gather(feats_t), _gather(idxs)
    order = torch.argsort(idxs)
    idxs, feats_i, feats_t = idxs[order], feats_i[order], feats_t[order]
    keep = torch.ones_like(idxs, dtype=torch.bool)
    keep[1:] = idxs[1:] != idxs[:-1]
    feats_i, feats_t = feats_i[keep], feats_t[keep]

    sim = feats_i @ feats_t.t()
    gt = torch.arange(sim.shape[0], device=sim.device)
    metrics = {}
    for k in (1, 5, 10):
        metrics[f"i2t_R@{k}"] = (sim.topk(k, dim=1).indices == gt[:, None]).any(1).float().mean().item()
        metrics[f"t2i_R@{k}"] = (sim.t().topk(k, dim=1).indices == gt[:, None]).any(1).float().mean().item()
    model.train()
    return metrics


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--resume", default=None)
    args = ap.parse_args()
    with open(args.config) as f:
        cfg = yaml.safe_load(f)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    is_master = rank == 0
    torch.manual_seed(cfg.get("seed", 0) + rank)

    model, preprocess_train, preprocess_val = open_clip.create_model_and_transforms(cfg["model"], pretrained=None)
    tokenizer = open_clip.get_tokenizer(cfg["model"])
    model = model.cuda()
    model = DDP(model, device_ids=[local_rank])

    train_ds = CsvDataset(cfg["train_csv"], preprocess_train, tokenizer)
    val_ds = CsvDataset(cfg["val_csv"], preprocess_val, tokenizer)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=cfg.get("seed", 0))
    val_sampler = DistributedSampler(val_ds, shuffle=False)
    # drop_last keeps the per-rank batch size fixed for all_gather
    train_loader = DataLoader(train_ds, batch_size=cfg["batch_size"], sampler=train_sampler,
                              num_workers=cfg.get("workers", 8), pin_memory=True, drop_last=True,
                              persistent_workers=True)
    val_loader = DataLoader(val_ds, batch_size=256, sampler=val_sampler, num_workers=4)

    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (no_decay if p.ndim < 2 or "logit_scale" in n or "bn" in n or "ln" in n else decay).append(p)
    optimizer = torch.optim.AdamW([
        {"params": decay, "weight_decay": cfg["wd"]},
        {"params": no_decay, "weight_decay": 0.0},
    ], lr=cfg["lr"], betas=(0.9, 0.98), eps=1e-6)
    scaler = torch.cuda.amp.GradScaler()
    total_steps = len(train_loader) * cfg["epochs"]
    set_lr = cosine_lr(optimizer, cfg["lr"], cfg["warmup"], total_steps)

    start_epoch = 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location=f"cuda:{local_rank}")
        model.module.load_state_dict(ckpt["state_dict"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch = ckpt["epoch"]
        if is_master:
            print(f"resumed from {args.resume} at epoch {start_epoch}")

    if is_master:
        os.makedirs(cfg["output_dir"], exist_ok=True)
        print(f"global batch {cfg['batch_size'] * world_size}, {total_steps} steps")

    for epoch in range(start_epoch, cfg["epochs"]):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for i, (images, texts, _) in enumerate(train_loader):
            step = epoch * len(train_loader) + i
            lr = set_lr(step)
            images = images.cuda(non_blocking=True)
            texts = texts.cuda(non_blocking=True)
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.float16):
                image_features, text_features, logit_scale = model(images, texts)
                loss = clip_loss(image_features, text_features, logit_scale, rank)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            with torch.no_grad():
                model.module.logit_scale.clamp_(0, math.log(100))

            if i % 100 == 0:
                reduced = loss.detach().clone()
                dist.all_reduce(reduced, op=dist.ReduceOp.AVG)
                if is_master:
                    print(f"epoch {epoch} [{i}/{len(train_loader)}] loss {reduced.item():.4f} "
                          f"scale {logit_scale.item():.2f} lr {lr:.2e} {time.time() - t0:.1f}s", flush=True)

        metrics = retrieval_eval(model, val_loader, world_size)
        if is_master:
            print(f"epoch {epoch} eval: " + " ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
            torch.save({
                "epoch": epoch + 1,
                "state_dict": model.module.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scaler": scaler.state_dict(),
                "cfg": cfg,
            }, os.path.join(cfg["output_dir"], "epoch_latest.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
