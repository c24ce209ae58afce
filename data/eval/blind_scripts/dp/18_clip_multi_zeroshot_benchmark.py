"""CLIP ViT-B/32 on CC12M shards with a small zero-shot benchmark (ImageNet, CIFAR-10, CIFAR-100) each epoch.

    torchrun --nproc_per_node=8 18_clip_multi_zeroshot_benchmark.py \
        --train-data '/data/cc12m/{00000..01242}.tar' --imagenet-val /data/imagenet/val --cifar-root /data/cifar
"""
import argparse
import json
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
from torch.utils.data import DataLoader, Subset

import open_clip
from open_clip.zero_shot_metadata import IMAGENET_CLASSNAMES, OPENAI_IMAGENET_TEMPLATES

CIFAR_TEMPLATES = (
    lambda c: f"a photo of a {c}.",
    lambda c: f"a blurry photo of a {c}.",
    lambda c: f"a low contrast photo of a {c}.",
    lambda c: f"a photo of the big {c}.",
    lambda c: f"a photo of the small {c}.",
)


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train-data", required=True)
    p.add_argument("--train-num-samples", type=int, default=10_000_000)
    p.add_argument("--imagenet-val", default=None)
    p.add_argument("--cifar-root", default=None)
    p.add_argument("--model", default="ViT-B-32")
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--wd", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=3000)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--output", default="./runs/b32_cc12m_zs")
    return p.parse_args()


def gathered_loss(img, txt, scale, rank, world):
    imgs = [torch.zeros_like(img) for _ in range(world)]
    txts = [torch.zeros_like(txt) for _ in range(world)]
    dist.all_gather(imgs, img)
    dist.all_gather(txts, txt)
    imgs[rank], txts[rank] = img, txt
    all_img, all_txt = torch.cat(imgs), torch.cat(txts)
    logits = scale * all_img @ all_txt.t()
    y = torch.arange(logits.shape[0], device=logits.device)
    return 0.5 * (F.cross_entropy(logits, y) + F.cross_entropy(logits.t(), y))


@torch.no_grad()
def zeroshot_weights(model, tokenizer, classnames, templates, device="cuda:0"):
    weights = []
    for name in classnames:
        tokens = tokenizer([t(name) for t in templates]).to(device)
        emb = model.encode_text(tokens, normalize=True).mean(dim=0)
        weights.append(emb / emb.norm())
    return torch.stack(weights, dim=1)


@torch.no_grad()
def zeroshot_accuracy(model, classifier, dataset, rank, world, device):
    shard = Subset(dataset, range(rank, len(dataset), world))
    loader = DataLoader(shard, batch_size=256, num_workers=6, pin_memory=True)
    hits = torch.zeros(2, device=device)
    for images, labels in loader:
        images, labels = images.to(device), labels.to(device)
        with torch.autocast("cuda"):
            feats = model.encode_image(images, normalize=True)
        hits[0] += ((feats.float() @ classifier.float()).argmax(1) == labels).sum()
        hits[1] += labels.numel()
    dist.all_reduce(hits)
    return (hits[0] / hits[1]).item()


def run_benchmark(model, tokenizer, preprocess, args, rank, world, device):
    model.eval()
    suites = []
    if args.imagenet_val:
        suites.append(("imagenet", torchvision.datasets.ImageFolder(args.imagenet_val, transform=preprocess),
                       IMAGENET_CLASSNAMES, OPENAI_IMAGENET_TEMPLATES))
    if args.cifar_root:
        c10 = torchvision.datasets.CIFAR10(args.cifar_root, train=False, transform=preprocess)
        c100 = torchvision.datasets.CIFAR100(args.cifar_root, train=False, transform=preprocess)
        suites.append(("cifar10", c10, c10.classes, CIFAR_TEMPLATES))
        suites.append(("cifar100", c100, c100.classes, CIFAR_TEMPLATES))
    results = {}
    for name, ds, classnames, templates in suites:
        classifier = zeroshot_weights(model, tokenizer, classnames, templates)
        results[name] = zeroshot_accuracy(model, classifier, ds, rank, world, device)
    model.train()
    return results


def build_train_loader(args, preprocess, tokenizer, world):
    urls = list(braceexpand.braceexpand(args.train_data))
    n_batches = math.ceil(args.train_num_samples / (args.batch_size * world))
    per_worker = math.ceil(n_batches / args.workers)
    ds = wds.DataPipeline(
        wds.ResampledShards(urls),
        wds.tarfile_to_samples(handler=wds.warn_and_continue),
        wds.shuffle(bufsize=5000, initial=1000),
        wds.decode("pilrgb", handler=wds.warn_and_continue),
        wds.rename(image="jpg;png;jpeg;webp", text="txt"),
        wds.map_dict(image=preprocess, text=lambda t: tokenizer(t)[0]),
        wds.to_tuple("image", "text"),
        wds.batched(args.batch_size, partial=False),
    ).with_epoch(per_worker)
    return wds.WebLoader(ds, batch_size=None, num_workers=args.workers, persistent_workers=True), per_worker * args.workers


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")

    model, preprocess_train, preprocess_val = open_clip.create_model_and_transforms(args.model, device=device)
    tokenizer = open_clip.get_tokenizer(args.model)
    ddp_model = DDP(model, device_ids=[local_rank])

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "logit_scale" not in n]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2 or "logit_scale" in n]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.wd}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.98), eps=1e-6)
    scaler = torch.cuda.amp.GradScaler()
    loader, steps_per_epoch = build_train_loader(args, preprocess_train, tokenizer, world)
    total = steps_per_epoch * args.epochs

    def lr_at(s):
        return args.lr * (s + 1) / args.warmup if s < args.warmup else \
            0.5 * args.lr * (1 + math.cos(math.pi * (s - args.warmup) / (total - args.warmup)))

    if rank == 0:
        os.makedirs(args.output, exist_ok=True)

    step = 0
    for epoch in range(args.epochs):
        ddp_model.train()
        t0 = time.time()
        for images, texts in loader:
            for g in opt.param_groups:
                g["lr"] = lr_at(step)
            images, texts = images.to(device, non_blocking=True), texts.to(device, non_blocking=True)
            with torch.autocast("cuda"):
                img, txt, scale = ddp_model(images, texts)
                loss = gathered_loss(img, txt, scale, rank, world)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            with torch.no_grad():
                model.logit_scale.clamp_(0, math.log(100))
            step += 1
            if rank == 0 and step % 100 == 0:
                print(f"epoch {epoch} step {step} loss {loss.item():.4f} scale {scale.item():.2f} "
                      f"{100 * args.batch_size * world / (time.time() - t0):.0f} samples/s", flush=True)
                t0 = time.time()

        results = run_benchmark(model, tokenizer, preprocess_val, args, rank, world, device)
        if rank == 0:
            print(f"epoch {epoch} zero-shot: {results}", flush=True)
            with open(os.path.join(args.output, "zeroshot.jsonl"), "a") as f:
                f.write(json.dumps({"epoch": epoch, "step": step, **results}) + "\n")
            torch.save({"epoch": epoch + 1, "step": step, "state_dict": model.state_dict(),
                        "optimizer": opt.state_dict(), "scaler": scaler.state_dict()},
                       os.path.join(args.output, "latest.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
