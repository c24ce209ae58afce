"""Fine-tune OpenAI CLIP ViT-L/14 for image-text retrieval on Flickr30k (Karpathy split)
with in-batch contrastive loss over the global batch; report R@1/5/10 on the 1k test set.

    torchrun --nproc_per_node=8 19_clip_flickr30k_retrieval.py --ann-dir /data/flickr30k/karpathy \
        --image-root /data/flickr30k/flickr30k-images --out runs/clip_l14_f30k
"""
import argparse
import json
import math
import os

import torch
import torch.distributed as dist
import torch.distributed.nn as dist_nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import CLIPModel, CLIPProcessor


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--ann-dir", required=True)
    p.add_argument("--image-root", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="openai/clip-vit-large-patch14")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--wd", type=float, default=0.2)
    p.add_argument("--warmup-ratio", type=float, default=0.1)
    return p.parse_args()


class F30kTrain(Dataset):
    def __init__(self, ann, root, processor):
        self.ann, self.root, self.processor = ann, root, processor

    def __len__(self):
        return len(self.ann)

    def __getitem__(self, i):
        a = self.ann[i]
        pix = self.processor(images=Image.open(os.path.join(self.root, a["image"])).convert("RGB"),
                             return_tensors="pt").pixel_values[0]
        return pix, a["caption"]


class F30kImages(Dataset):
    def __init__(self, ann, root, processor):
        self.ann, self.root, self.processor = ann, root, processor

    def __len__(self):
        return len(self.ann)

    def __getitem__(self, i):
        pix = self.processor(images=Image.open(os.path.join(self.root, self.ann[i]["image"])).convert("RGB"),
                             return_tensors="pt").pixel_values[0]
        return pix, i


def gather_cpu_features(local_feats, local_idx, n_total):
    """Collect per-rank features into one [n_total, D] matrix ordered by dataset index."""
    world = dist.get_world_size()
    feats = [torch.zeros_like(local_feats) for _ in range(world)]
    idx = [torch.zeros_like(local_idx) for _ in range(world)]
    dist.all_gather(feats, local_feats)
    dist.all_gather(idx, local_idx)
    out = torch.zeros(n_total, local_feats.size(1))
    out[torch.cat(idx)] = torch.cat(feats)      # padded duplicates land on the same row
    return out


@torch.no_grad()
def evaluate(model, processor, test_ann, root, device, world, rank):
    model.eval()
    img_ds = F30kImages(test_ann, root, processor)
    loader = DataLoader(img_ds, batch_size=128, num_workers=4,
                        sampler=DistributedSampler(img_ds, num_replicas=world, rank=rank, shuffle=False))
    img_f, img_i = [], []
    for pix, idx in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            f = model.get_image_features(pixel_values=pix.to(device))
        img_f.append(F.normalize(f.float(), dim=-1).cpu())
        img_i.append(idx)
    img_feats = gather_cpu_features(torch.cat(img_f), torch.cat(img_i), len(img_ds))

    texts = [(i, c) for i, a in enumerate(test_ann) for c in a["caption"]]
    txt_f = []
    for s in range(0, len(texts), 256):
        enc = processor(text=[c for _, c in texts[s:s + 256]], padding=True, truncation=True,
                        return_tensors="pt").to(device)
        with torch.autocast("cuda", dtype=torch.float16):
            txt_f.append(F.normalize(model.get_text_features(**enc).float(), dim=-1).cpu())
    txt_feats = torch.cat(txt_f)
    txt2img = torch.tensor([i for i, _ in texts])

    sim = img_feats @ txt_feats.t()
    res = {}
    for k in (1, 5, 10):
        topk_t = sim.topk(k, dim=1).indices                         # image -> text
        res[f"i2t_R@{k}"] = (txt2img[topk_t] == torch.arange(len(img_feats))[:, None]).any(1).float().mean().item()
        topk_i = sim.t().topk(k, dim=1).indices                     # text -> image
        res[f"t2i_R@{k}"] = (topk_i == txt2img[:, None]).any(1).float().mean().item()
    model.train()
    return res


def main():
    args = parse_args()
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    processor = CLIPProcessor.from_pretrained(args.model)
    model = CLIPModel.from_pretrained(args.model).to(device)
    ddp = DDP(model, device_ids=[local_rank])

    train_ann = json.load(open(os.path.join(args.ann_dir, "flickr30k_train.json")))
    test_ann = json.load(open(os.path.join(args.ann_dir, "flickr30k_test.json")))
    train_ds = F30kTrain(train_ann, args.image_root, processor)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=8, drop_last=True,
                        pin_memory=True, collate_fn=lambda b: (torch.stack([x[0] for x in b]), [x[1] for x in b]))

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.wd, betas=(0.9, 0.98), eps=1e-6)
    total = args.epochs * len(loader)
    warm = int(args.warmup_ratio * total)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: s / max(1, warm) if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / (total - warm))))
    scaler = torch.cuda.amp.GradScaler()

    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        ddp.train()
        for it, (pix, caps) in enumerate(loader):
            enc = processor(text=list(caps), padding=True, truncation=True, return_tensors="pt").to(device)
            with torch.autocast("cuda", dtype=torch.float16):
                out = ddp(pixel_values=pix.to(device, non_blocking=True), **enc)
                img = F.normalize(out.image_embeds.float(), dim=-1)
                txt = F.normalize(out.text_embeds.float(), dim=-1)
            all_img = torch.cat(dist_nn.all_gather(img), 0)
            all_txt = torch.cat(dist_nn.all_gather(txt), 0)
            scale = model.logit_scale.exp()
            labels = torch.arange(img.size(0), device=device) + rank * img.size(0)
            loss = (F.cross_entropy(scale * img @ all_txt.t(), labels)
                    + F.cross_entropy(scale * txt @ all_img.t(), labels)) / 2
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            sched.step()
            if rank == 0 and it % 50 == 0:
                print(f"epoch {epoch} it {it}/{len(loader)} loss {loss.item():.4f} scale {scale.item():.1f}", flush=True)

        res = evaluate(model, processor, test_ann, args.image_root, device, world, rank)
        if rank == 0:
            rsum = sum(res.values()) * 100
            print(f"epoch {epoch} " + " ".join(f"{k} {v * 100:.2f}" for k, v in res.items()) + f" rsum {rsum:.1f}",
                  flush=True)
            if rsum > best:
                best = rsum
                model.save_pretrained(os.path.join(args.out, "best"))
                processor.save_pretrained(os.path.join(args.out, "best"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
