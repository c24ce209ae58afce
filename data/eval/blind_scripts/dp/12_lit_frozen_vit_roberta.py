"""LiT: locked timm ViT-B/16 (IN-21k) image tower, RoBERTa text tower, CC12M webdataset.

Multi-node:
    torchrun --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint node01:29500 \
        12_lit_frozen_vit_roberta.py --shards "/shared/cc12m/{00000..01242}.tar" \
        --imagenet-val /shared/imagenet/val --out /shared/runs/lit_b16_roberta
"""
import argparse
import math
import os
import time

import braceexpand
import timm
import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import webdataset as wds
from timm.data import create_transform, resolve_data_config
from torch.nn.parallel import DistributedDataParallel as DDP
from transformers import AutoModel, AutoTokenizer

from open_clip.zero_shot_metadata import IMAGENET_CLASSNAMES, SIMPLE_IMAGENET_TEMPLATES


class LiT(nn.Module):
    def __init__(self, vision_name, text_name, embed_dim=768):
        super().__init__()
        self.visual = timm.create_model(vision_name, pretrained=True, num_classes=0)
        for p in self.visual.parameters():
            p.requires_grad = False
        self.visual.eval()
        # no pooler: we mean-pool the last hidden state ourselves
        self.text = AutoModel.from_pretrained(text_name, add_pooling_layer=False)
        self.image_proj = nn.Linear(self.visual.num_features, embed_dim)
        self.text_proj = nn.Linear(self.text.config.hidden_size, embed_dim)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(10.0)))

    def train(self, mode=True):
        super().train(mode)
        self.visual.eval()  # locked tower stays in eval mode (dropout / drop-path off)
        return self

    def encode_image(self, x):
        with torch.no_grad():
            feats = self.visual(x)
        return F.normalize(self.image_proj(feats), dim=-1)

    def encode_text(self, ids, mask):
        h = self.text(input_ids=ids, attention_mask=mask).last_hidden_state
        m = mask.unsqueeze(-1).to(h.dtype)
        pooled = (h * m).sum(1) / m.sum(1).clamp(min=1.0)
        return F.normalize(self.text_proj(pooled), dim=-1)

    def forward(self, x, ids, mask):
        return self.encode_image(x), self.encode_text(ids, mask), self.logit_scale.exp()


def clip_loss(img, txt, scale):
    # autograd-aware all_gather: every rank gets the gradient for its own slice back
    all_img = torch.cat(dist_fn.all_gather(img), 0)
    all_txt = torch.cat(dist_fn.all_gather(txt), 0)
    logits = scale * all_img @ all_txt.t()
    y = torch.arange(logits.shape[0], device=logits.device)
    return (F.cross_entropy(logits, y) + F.cross_entropy(logits.t(), y)) / 2


def build_loader(shards, transform, tokenizer, batch_size, workers, n_batches_per_worker, max_len):
    def collate(samples):
        imgs, caps = zip(*samples)
        tok = tokenizer(list(caps), padding="max_length", truncation=True, max_length=max_len, return_tensors="pt")
        return torch.stack(imgs), tok.input_ids, tok.attention_mask

    ds = (
        wds.DataPipeline(
            wds.ResampledShards(shards),
            wds.tarfile_to_samples(handler=wds.warn_and_continue),
            wds.shuffle(10000, initial=2000),
            wds.decode("pilrgb", handler=wds.warn_and_continue),
            wds.to_tuple("jpg;png;jpeg", "txt", handler=wds.warn_and_continue),
            wds.map_tuple(transform, str.strip),
            wds.batched(batch_size, collation_fn=collate, partial=False),
        )
        .with_epoch(n_batches_per_worker)
    )
    return wds.WebLoader(ds, batch_size=None, num_workers=workers, persistent_workers=True, pin_memory=True)


@torch.no_grad()
def zero_shot(model, tokenizer, root, transform, device, max_len):
    loader = torch.utils.data.DataLoader(torchvision.datasets.ImageFolder(root, transform), batch_size=256,
                                         num_workers=8)
    model.eval()
    weights = []
    for c in IMAGENET_CLASSNAMES:
        tok = tokenizer([t(c) for t in SIMPLE_IMAGENET_TEMPLATES], padding="max_length", truncation=True,
                        max_length=max_len, return_tensors="pt").to(device)
        weights.append(F.normalize(model.encode_text(tok.input_ids, tok.attention_mask).mean(0), dim=0))
    W = torch.stack(weights, 1)
    correct = total = 0
    for x, y in loader:
        pred = (model.encode_image(x.to(device)) @ W).argmax(1)
        correct += (pred == y.to(device)).sum().item()
        total += y.numel()
    model.train()
    return correct / total


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shards", required=True)
    ap.add_argument("--imagenet-val", default=None)
    ap.add_argument("--vision", default="vit_base_patch16_224.augreg_in21k")
    ap.add_argument("--text", default="roberta-base")
    ap.add_argument("--samples-per-epoch", type=int, default=10_000_000)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=512)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--wd", type=float, default=1e-4)
    ap.add_argument("--warmup", type=int, default=1000)
    ap.add_argument("--max-len", type=int, default=32)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--out", required=True)
    ap.add_argument("--resume", default=None)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    model = LiT(args.vision, args.text).to(device)
    start_epoch = 0
    if args.resume:
        ck = torch.load(args.resume, map_location="cpu")
        model.load_state_dict(ck["model"])
        start_epoch = ck["epoch"]
    data_cfg = resolve_data_config({}, model=model.visual)
    train_tf = create_transform(**data_cfg, is_training=True)
    val_tf = create_transform(**data_cfg, is_training=False)
    tokenizer = AutoTokenizer.from_pretrained(args.text)

    # frozen tower was locked before wrapping, so DDP only tracks the trainable parameters
    ddp = DDP(model, device_ids=[local_rank], broadcast_buffers=False, gradient_as_bucket_view=True)

    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=args.wd)
    if args.resume:
        opt.load_state_dict(ck["opt"])
        del ck

    shards = list(braceexpand.braceexpand(args.shards))
    steps_per_epoch = math.ceil(args.samples_per_epoch / (args.batch_size * world))
    per_worker = math.ceil(steps_per_epoch / args.workers)
    steps_per_epoch = per_worker * args.workers
    loader = build_loader(shards, train_tf, tokenizer, args.batch_size, args.workers, per_worker, args.max_len)
    total = steps_per_epoch * args.epochs

    def lr_at(s):
        if s < args.warmup:
            return args.lr * (s + 1) / args.warmup
        return args.lr * 0.5 * (1 + math.cos(math.pi * (s - args.warmup) / (total - args.warmup)))

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"trainable params: {sum(p.numel() for p in params) / 1e6:.1f}M, world {world}, "
              f"global batch {args.batch_size * world}, {steps_per_epoch} steps/epoch", flush=True)

    step = start_epoch * steps_per_epoch
    for epoch in range(start_epoch, args.epochs):
        ddp.train()
        t0 = time.time()
        for ims, ids, mask in loader:
            for g in opt.param_groups:
                g["lr"] = lr_at(step)
            ims, ids, mask = ims.to(device, non_blocking=True), ids.to(device), mask.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                img, txt, scale = ddp(ims, ids, mask)
            loss = clip_loss(img.float(), txt.float(), scale)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            with torch.no_grad():
                model.logit_scale.clamp_(0, math.log(100))
            step += 1
            if rank == 0 and step % 100 == 0:
                print(f"ep {epoch} step {step} loss {loss.item():.4f} scale {scale.item():.1f} "
                      f"{(time.time() - t0) / 100:.3f}s/step", flush=True)
                t0 = time.time()

        if rank == 0:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "epoch": epoch + 1},
                       os.path.join(args.out, "checkpoint.pt"))
            if args.imagenet_val:
                acc = zero_shot(model, tokenizer, args.imagenet_val, val_tf, device, args.max_len)
                print(f"epoch {epoch} zero-shot top1 {100 * acc:.2f}", flush=True)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
