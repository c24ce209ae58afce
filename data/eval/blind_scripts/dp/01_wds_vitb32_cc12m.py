#!/usr/bin/env python
"""ViT-B/32 CLIP pretraining on CC12M webdataset shards.

Reproduction of the open_clip ViT-B/32 CC12M baseline. Launch with torchrun,
one process per GPU.
"""
import argparse
import json
import logging
import math
import os
import time

import braceexpand
import torch
import torch.distributed as dist
import torch.nn.functional as F
import torchvision
import webdataset as wds
from torch.nn.parallel import DistributedDataParallel as DDP

import open_clip
from open_clip.zero_shot_metadata import IMAGENET_CLASSNAMES, OPENAI_IMAGENET_TEMPLATES

logger = logging.getLogger("clip")


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train-data", required=True, help="e.g. /data/cc12m/{00000..01242}.tar")
    p.add_argument("--train-num-samples", type=int, default=10_968_539)
    p.add_argument("--imagenet-val", default=None)
    p.add_argument("--model", default="ViT-B-32")
    p.add_argument("--batch-size", type=int, default=256, help="per GPU")
    p.add_argument("--epochs", type=int, default=32)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--wd", type=float, default=0.2)
    p.add_argument("--warmup", type=int, default=2000)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--precision", default="amp")
    p.add_argument("--log-every", type=int, default=100)
    p.add_argument("--output-dir", default="./logs/vitb32_cc12m")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def init_distributed():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    return dist.get_rank(), dist.get_world_size(), local_rank


class ClipLoss(torch.nn.Module):
    def __init__(self, rank, world_size):
        super().__init__()
        self.rank = rank
        self.world_size = world_size

    def gather(self, image_features, text_features):
        all_img = [torch.zeros_like(image_features) for _ in range(self.world_size)]
        all_txt = [torch.zeros_like(text_features) for _ in range(self.world_size)]
        dist.all_gather(all_img, image_features)
        dist.all_gather(all_txt, text_features)
        # put the local features back so they keep their autograd graph
        all_img[self.rank] = image_features
        all_txt[self.rank] = text_features
        return torch.cat(all_img), torch.cat(all_txt)

    def forward(self, image_features, text_features, logit_scale):
        all_img, all_txt = self.gather(image_features, text_features)
        logits_per_image = logit_scale * all_img @ all_txt.t()
        logits_per_text = logits_per_image.t()
        labels = torch.arange(logits_per_image.shape[0], device=image_features.device)
        return (F.cross_entropy(logits_per_image, labels) + F.cross_entropy(logits_per_text, labels)) / 2


def make_train_loader(args, preprocess, tokenizer):
    shards = list(braceexpand.braceexpand(args.train_data))
    pipeline = wds.DataPipeline(
        wds.SimpleShardList(shards),
        wds.detshuffle(bufsize=2000, initial=500, seed=args.seed),
        wds.split_by_node,
        wds.split_by_worker,
        wds.tarfile_to_samples(handler=wds.warn_and_continue),
        wds.shuffle(bufsize=5000, initial=1000),
        wds.decode("pilrgb", handler=wds.warn_and_continue),
        wds.rename(image="jpg;png;jpeg;webp", text="txt"),
        wds.map_dict(image=preprocess, text=lambda t: tokenizer(t)[0]),
        wds.to_tuple("image", "text"),
        wds.batched(args.batch_size, partial=False),
    )
    loader = wds.WebLoader(
        pipeline, batch_size=None, shuffle=False, num_workers=args.workers, persistent_workers=True
    )
    return loader, len(shards)


def cosine_lr(optimizer, base_lr, warmup, total_steps):
    def _step(step):
        if step < warmup:
            lr = base_lr * (step + 1) / warmup
        else:
            e = step - warmup
            es = total_steps - warmup
            lr = 0.5 * (1 + math.cos(math.pi * e / es)) * base_lr
        for g in optimizer.param_groups:
            g["lr"] = lr
        return lr
    return _step


@torch.no_grad()
def zero_shot_eval(model, tokenizer, preprocess, args, device):
    dataset = torchvision.datasets.ImageFolder(args.imagenet_val, transform=preprocess)
    loader = torch.utils.data.DataLoader(dataset, batch_size=256, num_workers=args.workers)
    weights = []
    for name in IMAGENET_CLASSNAMES:
        tokens = tokenizer([t(name) for t in OPENAI_IMAGENET_TEMPLATES]).to(device)
        emb = F.normalize(model.encode_text(tokens), dim=-1).mean(0)
        weights.append(F.normalize(emb, dim=0))
    classifier = torch.stack(weights, dim=1)
    top1 = top5 = n = 0
    for images, target in loader:
        images, target = images.to(device), target.to(device)
        with torch.autocast("cuda"):
            feats = F.normalize(model.encode_image(images), dim=-1)
        logits = 100.0 * feats.float() @ classifier.float()
        pred = logits.topk(5, dim=1).indices
        correct = pred.eq(target.view(-1, 1))
        top1 += correct[:, :1].sum().item()
        top5 += correct.sum().item()
        n += images.size(0)
    return {"imagenet-top1": top1 / n, "imagenet-top5": top5 / n}


def main():
    args = parse_args()
    rank, world_size, local_rank = init_distributed()
    device = torch.device("cuda", local_rank)
    is_master = rank == 0
    logging.basicConfig(level=logging.INFO if is_master else logging.WARNING,
                        format="%(asctime)s | %(message)s")
    torch.manual_seed(args.seed)

    model, preprocess_train, preprocess_val = open_clip.create_model_and_transforms(
        args.model, pretrained=None, device=device
    )
    tokenizer = open_clip.get_tokenizer(args.model)
    model = DDP(model, device_ids=[local_rank])

    exclude = lambda n, p: p.ndim < 2 or "bn" in n or "ln" in n or "bias" in n or "logit_scale" in n
    decay = [p for n, p in model.named_parameters() if not exclude(n, p) and p.requires_grad]
    no_decay = [p for n, p in model.named_parameters() if exclude(n, p) and p.requires_grad]
    optimizer = torch.optim.AdamW(
        [{"params": no_decay, "weight_decay": 0.0}, {"params": decay, "weight_decay": args.wd}],
        lr=args.lr, betas=(0.9, 0.98), eps=1e-6,
    )
    scaler = torch.cuda.amp.GradScaler() if args.precision == "amp" else None

    loader, num_shards = make_train_loader(args, preprocess_train, tokenizer)
    global_batch = args.batch_size * world_size
    steps_per_epoch = math.ceil(args.train_num_samples / global_batch)
    total_steps = steps_per_epoch * args.epochs
    scheduler = cosine_lr(optimizer, args.lr, args.warmup, total_steps)
    loss_fn = ClipLoss(rank, world_size)
    logger.info("world=%d global_batch=%d shards=%d steps/epoch=%d",
                world_size, global_batch, num_shards, steps_per_epoch)

    if is_master:
        os.makedirs(os.path.join(args.output_dir, "checkpoints"), exist_ok=True)
        with open(os.path.join(args.output_dir, "params.json"), "w") as f:
            json.dump(vars(args), f, indent=2)

    step = 0
    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        for i, (images, texts) in enumerate(loader):
            lr = scheduler(step)
            images = images.to(device, non_blocking=True)
            texts = texts.to(device, non_blocking=True)
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast("cuda", enabled=scaler is not None):
                image_features, text_features, logit_scale = model(images, texts)
                loss = loss_fn(image_features, text_features, logit_scale)
            if scaler is not None:
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
                optimizer.step()
            with torch.no_grad():
                model.module.logit_scale.clamp_(0, math.log(100))
            step += 1
            if is_master and i % args.log_every == 0:
                dt = time.time() - t0
                logger.info("ep %d it %d loss %.4f scale %.2f lr %.2e %.1f samples/s",
                            epoch, i, loss.item(), logit_scale.item(), lr,
                            global_batch * (i + 1) / max(dt, 1e-6))

        if is_master:
            ckpt = {
                "epoch": epoch + 1,
                "step": step,
                "state_dict": model.module.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scaler": scaler.state_dict() if scaler is not None else None,
            }
            torch.save(ckpt, os.path.join(args.output_dir, "checkpoints", f"epoch_{epoch + 1}.pt"))
            if args.imagenet_val:
                model.eval()
                metrics = zero_shot_eval(model.module, tokenizer, preprocess_val, args, device)
                logger.info("epoch %d zero-shot %s", epoch + 1, metrics)
                with open(os.path.join(args.output_dir, "results.jsonl"), "a") as f:
                    f.write(json.dumps({"epoch": epoch + 1, **metrics}) + "\n")
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
