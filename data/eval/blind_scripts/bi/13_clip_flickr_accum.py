"""CLIP ViT-B/32 training with gradient accumulation and Flickr30k retrieval evaluation.

    torchrun --nproc_per_node 4 13_clip_flickr_accum.py --train-jsonl /data/yfcc15m/train.jsonl \
        --flickr-json /data/flickr30k/dataset_flickr30k.json --accum 4
"""
import argparse
import json
import math
import os
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

import open_clip


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train-jsonl", required=True)
    ap.add_argument("--image-root", default="/data")
    ap.add_argument("--flickr-json", required=True)
    ap.add_argument("--flickr-images", default="/data/flickr30k/images")
    ap.add_argument("--model", default="ViT-B-32")
    ap.add_argument("--batch-size", type=int, default=256, help="per GPU micro-batch")
    ap.add_argument("--accum", type=int, default=1)
    ap.add_argument("--base-lr", type=float, default=5e-4, help="lr for a global batch of 4096")
    ap.add_argument("--epochs", type=int, default=25)
    ap.add_argument("--warmup-steps", type=int, default=2000)
    ap.add_argument("--wd", type=float, default=0.2)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--output", default="/shared/exp/clip_b32_yfcc")
    ap.add_argument("--resume", default=None)
    ap.add_argument("--wandb", action="store_true")
    return ap.parse_args()


class JsonlPairs(Dataset):
    def __init__(self, path, root, transform, tokenizer):
        with open(path) as f:
            self.rows = [json.loads(l) for l in f]
        self.root, self.transform, self.tokenizer = root, transform, tokenizer

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        img = Image.open(os.path.join(self.root, r["image"])).convert("RGB")
        return self.transform(img), self.tokenizer([r["caption"]])[0]


class IndexedImages(Dataset):
    def __init__(self, paths, indices, transform):
        self.paths, self.indices, self.transform = paths, indices, transform

    def __len__(self):
        return len(self.indices)

    def __getitem__(self, i):
        j = self.indices[i]
        return self.transform(Image.open(self.paths[j]).convert("RGB")), j


def contrastive_loss(img, txt, scale):
    # torch.distributed.nn's all_gather is differentiable, so each rank can use a local loss
    rank = dist.get_rank()
    all_img = torch.cat(dist_nn.all_gather(img))
    all_txt = torch.cat(dist_nn.all_gather(txt))
    labels = torch.arange(img.shape[0], device=img.device) + rank * img.shape[0]
    return (F.cross_entropy(scale * img @ all_txt.t(), labels) +
            F.cross_entropy(scale * txt @ all_img.t(), labels)) / 2


def all_gather_uneven(x):
    """all_gather for tensors whose first dim differs between ranks (pad, gather, trim)."""
    world = dist.get_world_size()
    n = torch.tensor([x.shape[0]], device=x.device)
    sizes = [torch.zeros_like(n) for _ in range(world)]
    dist.all_gather(sizes, n)
    sizes = [int(s.item()) for s in sizes]
    max_n = max(sizes)
    padded = torch.cat([x, x.new_zeros((max_n - x.shape[0],) + tuple(x.shape[1:]))])
    bufs = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(bufs, padded)
    return torch.cat([b[:s] for b, s in zip(bufs, sizes)])


@torch.no_grad()
def flickr_eval(model, tokenizer, flickr_json, image_dir, transform, device):
    rank, world = dist.get_rank(), dist.get_world_size()
    with open(flickr_json) as f:
        test = [im for im in json.load(f)["images"] if im["split"] == "test"]
    paths = [os.path.join(image_dir, im["filename"]) for im in test]
    captions = [s["raw"] for im in test for s in im["sentences"]]
    txt2img = torch.tensor([i for i, im in enumerate(test) for _ in im["sentences"]], device=device)

    model.eval()
    # strided, unpadded shards; all_gather_uneven copes with the different lengths
    loader = DataLoader(IndexedImages(paths, list(range(rank, len(paths), world)), transform),
                        batch_size=128, num_workers=4)
    feats, idx = [], []
    for images, j in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            feats.append(F.normalize(model.encode_image(images.to(device)).float(), dim=-1))
        idx.append(j.to(device))
    img_f = all_gather_uneven(torch.cat(feats))
    img_idx = all_gather_uneven(torch.cat(idx))
    img_f = img_f[img_idx.argsort()]

    # the 5000 captions are cheap: every rank encodes all of them
    txt_f = []
    for s in range(0, len(captions), 1000):
        with torch.autocast("cuda", dtype=torch.float16):
            txt_f.append(F.normalize(model.encode_text(tokenizer(captions[s:s + 1000]).to(device)).float(), dim=-1))
    txt_f = torch.cat(txt_f)

    sim = img_f @ txt_f.t()
    r = {}
    top_txt = sim.topk(10, dim=1).indices
    top_img = sim.t().topk(10, dim=1).indices
    for k in (1, 5, 10):
        r[f"i2t@{k}"] = (txt2img[top_txt[:, :k]] == torch.arange(len(test), device=device)[:, None]).any(1).float().mean().item()
        r[f"t2i@{k}"] = (top_img[:, :k] == txt2img[:, None]).any(1).float().mean().item()
    model.train()
    return r


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.manual_seed(0)

    model, train_tf, val_tf = open_clip.create_model_and_transforms(args.model)
    tokenizer = open_clip.get_tokenizer(args.model)
    model.to(device)

    global_batch = args.batch_size * args.accum * world
    lr = args.base_lr * global_batch / 4096
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": args.wd},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.98), eps=1e-6)
    scaler = torch.cuda.amp.GradScaler()

    start_epoch = 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch = ckpt["epoch"]
    model = DDP(model, device_ids=[local_rank])

    dataset = JsonlPairs(args.train_jsonl, args.image_root, train_tf, tokenizer)
    sampler = DistributedSampler(dataset, shuffle=True, drop_last=True)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True, persistent_workers=True)
    updates_per_epoch = len(loader) // args.accum
    total_updates = updates_per_epoch * args.epochs

    def set_lr(u):
        v = lr * (u + 1) / args.warmup_steps if u < args.warmup_steps else \
            0.5 * lr * (1 + math.cos(math.pi * (u - args.warmup_steps) / (total_updates - args.warmup_steps)))
        for g in optimizer.param_groups:
            g["lr"] = v
        return v

    run = None
    if rank == 0:
        os.makedirs(args.output, exist_ok=True)
        if args.wandb:
            import wandb
            run = wandb.init(project="clip-yfcc", config={**vars(args), "lr": lr, "global_batch": global_batch})

    update = start_epoch * updates_per_epoch
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        optimizer.zero_grad(set_to_none=True)
        for i, (images, texts) in enumerate(loader):
            if i >= updates_per_epoch * args.accum:
                break  # same count on every rank: the sampler gives each rank len(dataset)//world samples
            last_micro = (i + 1) % args.accum == 0
            images, texts = images.to(device, non_blocking=True), texts.to(device, non_blocking=True)
            with (nullcontext() if last_micro else model.no_sync()):
                with torch.autocast("cuda", dtype=torch.float16):
                    img, txt, scale = model(images, texts)
                    loss = contrastive_loss(img, txt, scale) / args.accum
                scaler.scale(loss).backward()
            if not last_micro:
                continue
            cur_lr = set_lr(update)
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            with torch.no_grad():
                model.module.logit_scale.clamp_(0, math.log(100))
            update += 1
            if rank == 0 and update % 50 == 0:
                msg = {"loss": loss.item() * args.accum, "lr": cur_lr, "scale": scale.item(),
                       "s_per_update": (time.time() - t0) / ((i + 1) / args.accum)}
                print(f"epoch {epoch} update {update}/{total_updates} {msg}", flush=True)
                if run is not None:
                    run.log(msg, step=update)

        metrics = flickr_eval(model.module, tokenizer, args.flickr_json, args.flickr_images, val_tf, device)
        if rank == 0:
            print(f"epoch {epoch} flickr30k test: {metrics}", flush=True)
            if run is not None:
                run.log({f"flickr/{k}": v for k, v in metrics.items()}, step=update)
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scaler": scaler.state_dict(), "epoch": epoch + 1},
                       os.path.join(args.output, f"epoch_{epoch + 1}.pt"))
        dist.barrier()

    if run is not None:
        run.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
