"""Fine-tune OpenAI CLIP ViT-B/16 on Flickr30k (Karpathy split) for image-text retrieval.

    torchrun --nproc_per_node=8 16_clip_flickr30k_finetune.py --ann /data/flickr30k/dataset_flickr30k.json
"""
import argparse
import json
import logging
import math
import os
import random

import torch
import torch.distributed as dist
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

import open_clip

logger = logging.getLogger("flickr_ft")


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--ann", required=True)
    p.add_argument("--images", default="/data/flickr30k/flickr30k-images")
    p.add_argument("--model", default="ViT-B-16")
    p.add_argument("--pretrained", default="openai")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--wd", type=float, default=0.2)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--workers", type=int, default=6)
    p.add_argument("--save-dir", default="/shared/ckpt/clip_b16_flickr")
    return p.parse_args()


class FlickrImages(Dataset):
    """One item per image with all of its captions."""

    def __init__(self, ann_path, split, image_dir, transform, train):
        with open(ann_path) as f:
            imgs = json.load(f)["images"]
        self.items = [(im["filename"], [s["raw"] for s in im["sentences"]]) for im in imgs
                      if im["split"] == split]
        self.image_dir, self.transform, self.train = image_dir, transform, train

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        fn, caps = self.items[i]
        img = self.transform(Image.open(os.path.join(self.image_dir, fn)).convert("RGB"))
        if self.train:
            return img, random.choice(caps)
        return img, caps


def eval_collate(batch):
    imgs, caps = zip(*batch)
    return torch.stack(imgs), list(caps)


def gather_no_grad(x):
    out = [torch.zeros_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(out, x)
    out[dist.get_rank()] = x
    return torch.cat(out)


def clip_loss(img, txt, scale):
    all_img, all_txt = gather_no_grad(img), gather_no_grad(txt)
    logits = scale * all_img @ all_txt.t()
    labels = torch.arange(len(all_img), device=img.device)
    return 0.5 * (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels))


@torch.no_grad()
def retrieval_eval(model, tokenizer, loader, device):
    model.eval()
    img_embs, txt_embs, txt2img = [], [], []
    n_img = 0
    for images, caps in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            img_embs.append(F.normalize(model.encode_image(images.to(device)).float(), dim=-1))
            for j, cs in enumerate(caps):
                toks = tokenizer(cs).to(device)
                txt_embs.append(F.normalize(model.encode_text(toks).float(), dim=-1))
                txt2img.extend([n_img + j] * len(cs))
        n_img += images.shape[0]
    img_embs, txt_embs = torch.cat(img_embs), torch.cat(txt_embs)
    txt2img = torch.tensor(txt2img, device=device)
    sim = img_embs @ txt_embs.t()

    out = {}
    # text retrieval: an image is correct at k if any of its captions is in the top k
    ranks = sim.argsort(dim=1, descending=True)
    hit = txt2img[ranks] == torch.arange(len(img_embs), device=device)[:, None]
    first = hit.float().argmax(dim=1)
    for k in (1, 5, 10):
        out[f"txt_r{k}"] = (first < k).float().mean().item() * 100
    ranks_t = sim.t().argsort(dim=1, descending=True)
    first_t = (ranks_t == txt2img[:, None]).float().argmax(dim=1)
    for k in (1, 5, 10):
        out[f"img_r{k}"] = (first_t < k).float().mean().item() * 100
    out["r_mean"] = sum(out.values()) / 6
    model.train()
    return out


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARN,
                        format="%(asctime)s [%(levelname)s] %(message)s")
    random.seed(1 + rank)
    torch.manual_seed(1)

    model, train_tf, val_tf = open_clip.create_model_and_transforms(args.model, pretrained=args.pretrained)
    tokenizer = open_clip.get_tokenizer(args.model)
    model = DDP(model.to(device), device_ids=[local_rank])

    train_set = FlickrImages(args.ann, "train", args.images, train_tf, train=True)
    test_set = FlickrImages(args.ann, "test", args.images, val_tf, train=False)
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    test_sampler = DistributedSampler(test_set, shuffle=False)
    test_loader = DataLoader(test_set, batch_size=128, sampler=test_sampler, num_workers=args.workers,
                             collate_fn=eval_collate)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.wd, betas=(0.9, 0.98),
                                  eps=1e-6)
    total = args.epochs * len(train_loader)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / args.warmup) * 0.5 * (1 + math.cos(math.pi * s / total)))
    scaler = torch.cuda.amp.GradScaler()

    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)
    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for i, (images, caps) in enumerate(train_loader):
            images = images.to(device, non_blocking=True)
            texts = tokenizer(list(caps)).to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                img, txt, scale = model(images, texts)
                loss = clip_loss(img, txt, scale)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            with torch.no_grad():
                model.module.logit_scale.clamp_(0, math.log(100))
            if i % 50 == 0:
                logger.info("epoch %d [%d/%d] loss %.4f lr %.2e", epoch, i, len(train_loader), loss.item(),
                            scheduler.get_last_lr()[0])

        metrics = retrieval_eval(model.module, tokenizer, test_loader, device)
        if rank == 0:
            logger.info("epoch %d test: %s", epoch, {k: round(v, 2) for k, v in metrics.items()})
            if metrics["r_mean"] > best:
                best = metrics["r_mean"]
                torch.save(model.module.state_dict(), os.path.join(args.save_dir, "best.pt"))
                logger.info("new best r_mean %.2f", best)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
