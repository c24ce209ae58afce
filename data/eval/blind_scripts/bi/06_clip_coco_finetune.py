"""Fine-tune an OpenCLIP checkpoint on COCO captions and report 5k-test retrieval recall.

Uses the Karpathy split json (dataset_coco.json). Every rank encodes a slice of the test set
and the features are all-gathered for the full 5k x 25k similarity matrix.
"""
import argparse
import json
import logging
import math
import os
import random

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

import open_clip

log = logging.getLogger(__name__)


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--karpathy-json", default="/data/coco/dataset_coco.json")
    ap.add_argument("--image-root", default="/data/coco")
    ap.add_argument("--model", default="ViT-B-32")
    ap.add_argument("--pretrained", default="laion2b_s34b_b79k")
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--wd", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=500)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--save-dir", default="/shared/ckpt/clip_coco_ft")
    return ap.parse_args()


def load_karpathy(path, split):
    with open(path) as f:
        images = json.load(f)["images"]
    if split == "train":
        images = [im for im in images if im["split"] in ("train", "restval")]
    else:
        images = [im for im in images if im["split"] == split]
    return images


class CocoPairs(Dataset):
    def __init__(self, images, root, transform, tokenizer):
        self.pairs = [(os.path.join(root, im["filepath"], im["filename"]), s["raw"])
                      for im in images for s in im["sentences"]]
        self.transform = transform
        self.tokenizer = tokenizer

    def __len__(self):
        return len(self.pairs)

    def __getitem__(self, i):
        path, cap = self.pairs[i]
        return self.transform(Image.open(path).convert("RGB")), self.tokenizer([cap])[0]


class ImageList(Dataset):
    def __init__(self, paths, transform):
        self.paths = paths
        self.transform = transform

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        return self.transform(Image.open(self.paths[i]).convert("RGB"))


def clip_loss(img, txt, scale):
    rank = dist.get_rank()
    all_img = torch.cat(dist_nn.all_gather(img))
    all_txt = torch.cat(dist_nn.all_gather(txt))
    n = img.shape[0]
    labels = torch.arange(n, device=img.device) + n * rank
    return 0.5 * (F.cross_entropy(scale * img @ all_txt.t(), labels) +
                  F.cross_entropy(scale * txt @ all_img.t(), labels))


def gather_cat(x):
    parts = [torch.zeros_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x)
    return torch.cat(parts)


@torch.no_grad()
def evaluate_retrieval(model, tokenizer, test_images, root, transform, device, workers):
    rank, world = dist.get_rank(), dist.get_world_size()
    model.eval()
    paths = [os.path.join(root, im["filepath"], im["filename"]) for im in test_images]
    captions, txt2img = [], []
    for i, im in enumerate(test_images):
        for s in im["sentences"]:
            captions.append(s["raw"])
            txt2img.append(i)

    # strided shards: rank r takes items r, r+world, ...
    img_idx = torch.arange(rank, len(paths), world)
    txt_idx = torch.arange(rank, len(captions), world)
    loader = DataLoader(ImageList([paths[i] for i in img_idx], transform), batch_size=256,
                        num_workers=workers)
    img_feats = []
    for images in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            img_feats.append(F.normalize(model.encode_image(images.to(device)).float(), dim=-1))
    local_caps = [captions[i] for i in txt_idx]
    txt_feats = []
    for s in range(0, len(local_caps), 512):
        tokens = tokenizer(local_caps[s:s + 512]).to(device)
        with torch.autocast("cuda", dtype=torch.float16):
            txt_feats.append(F.normalize(model.encode_text(tokens).float(), dim=-1))

    img_all = gather_cat(torch.cat(img_feats))
    txt_all = gather_cat(torch.cat(txt_feats))
    img_order = gather_cat(img_idx.to(device))
    txt_order = gather_cat(txt_idx.to(device))
    # back to dataset order
    img_all = img_all[img_order.argsort()]
    txt_all = txt_all[txt_order.argsort()]

    sim = img_all @ txt_all.t()
    t2i = torch.tensor(txt2img, device=device)
    metrics = {}
    topk_t = sim.topk(10, dim=1).indices                     # image -> text
    hit_i2t = (t2i[topk_t] == torch.arange(sim.shape[0], device=device)[:, None])
    topk_i = sim.t().topk(10, dim=1).indices                 # text -> image
    hit_t2i = (topk_i == t2i[:, None])
    for k in (1, 5, 10):
        metrics[f"i2t_R@{k}"] = hit_i2t[:, :k].any(1).float().mean().item()
        metrics[f"t2i_R@{k}"] = hit_t2i[:, :k].any(1).float().mean().item()
    model.train()
    return metrics


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR)
    random.seed(0)
    torch.manual_seed(0)

    model, train_tf, val_tf = open_clip.create_model_and_transforms(args.model, pretrained=args.pretrained)
    tokenizer = open_clip.get_tokenizer(args.model)
    model = DDP(model.to(device), device_ids=[local_rank])

    train_set = CocoPairs(load_karpathy(args.karpathy_json, "train"), args.image_root, train_tf, tokenizer)
    test_images = load_karpathy(args.karpathy_json, "test")
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.wd, betas=(0.9, 0.98),
                                  eps=1e-6)
    total = args.epochs * len(loader)
    sched = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: (s + 1) / args.warmup if s < args.warmup
        else 0.5 * (1 + math.cos(math.pi * (s - args.warmup) / max(1, total - args.warmup))))
    scaler = torch.cuda.amp.GradScaler()

    metrics = evaluate_retrieval(model.module, tokenizer, test_images, args.image_root, val_tf, device,
                                 args.workers)
    log.info("zero-shot before fine-tuning: %s", metrics)
    best = metrics["t2i_R@1"] + metrics["i2t_R@1"]
    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for it, (images, texts) in enumerate(loader):
            images, texts = images.to(device, non_blocking=True), texts.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                img, txt, scale = model(images, texts)
                loss = clip_loss(img, txt, scale)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            sched.step()
            with torch.no_grad():
                model.module.logit_scale.clamp_(0, math.log(100))
            if it % 100 == 0:
                log.info("epoch %d it %d/%d loss %.4f lr %.2e", epoch, it, len(loader), loss.item(),
                         sched.get_last_lr()[0])

        metrics = evaluate_retrieval(model.module, tokenizer, test_images, args.image_root, val_tf, device,
                                     args.workers)
        log.info("epoch %d: %s", epoch, " ".join(f"{k}={v:.4f}" for k, v in metrics.items()))
        score = metrics["t2i_R@1"] + metrics["i2t_R@1"]
        if rank == 0:
            torch.save({"model": model.module.state_dict(), "epoch": epoch, "metrics": metrics},
                       os.path.join(args.save_dir, "last.pt"))
            if score > best:
                best = score
                torch.save(model.module.state_dict(), os.path.join(args.save_dir, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
