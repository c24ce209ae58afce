"""Fine-tune HF CLIP for COCO image-text retrieval (Karpathy 5k test), logging to W&B.

    torchrun --nproc_per_node=8 10_clip_coco_retrieval_ft.py --coco-json /data/coco/dataset_coco.json \
        --image-root /data/coco --run-name clip-l14-coco-ft
"""
import argparse
import math
import json
import os
import random

import torch
import torch.distributed as dist
import torch.distributed.nn as dist_nn
import torch.nn.functional as F
import wandb
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import CLIPModel, CLIPProcessor


class CocoPairs(Dataset):
    def __init__(self, coco_json, root, split, processor):
        images = [im for im in json.load(open(coco_json))["images"]
                  if im["split"] in ((split, "restval") if split == "train" else (split,))]
        self.root, self.processor = root, processor
        if split == "train":
            self.items = [(os.path.join(im["filepath"], im["filename"]), s["raw"]) for im in images for s in im["sentences"]]
        else:
            # first 5 captions per image, image index = position // 5
            self.items = [(os.path.join(im["filepath"], im["filename"]), s["raw"]) for im in images for s in im["sentences"][:5]]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        path, cap = self.items[i]
        img = Image.open(os.path.join(self.root, path)).convert("RGB")
        return img, cap, i


def make_collate(processor):
    def collate(batch):
        imgs, caps, idx = zip(*batch)
        enc = processor(images=list(imgs), text=list(caps), padding="max_length", max_length=77,
                        truncation=True, return_tensors="pt")
        return enc["pixel_values"], enc["input_ids"], enc["attention_mask"], torch.tensor(idx)
    return collate


def global_contrastive_loss(img, txt, logit_scale):
    rank = dist.get_rank()
    all_img = torch.cat(dist_nn.all_gather(img))
    all_txt = torch.cat(dist_nn.all_gather(txt))
    labels = torch.arange(img.size(0), device=img.device) + rank * img.size(0)
    return 0.5 * (F.cross_entropy(logit_scale * img @ all_txt.T, labels) +
                  F.cross_entropy(logit_scale * txt @ all_img.T, labels))


@torch.no_grad()
def retrieval_metrics(model, loader, device):
    model.eval()
    m = model.module
    img_f, txt_f, ids = [], [], []
    for pix, input_ids, attn, idx in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            img_f.append(F.normalize(m.get_image_features(pixel_values=pix.to(device)).float(), dim=-1))
            txt_f.append(F.normalize(m.get_text_features(input_ids=input_ids.to(device),
                                                         attention_mask=attn.to(device)).float(), dim=-1))
        ids.append(idx.to(device))
    img_f, txt_f, ids = torch.cat(img_f), torch.cat(txt_f), torch.cat(ids)
    ws = dist.get_world_size()
    g = lambda t: torch.cat([x for x in _all_gather(t, ws)])
    img_f, txt_f, ids = g(img_f), g(txt_f), g(ids)
    order = ids.argsort()
    ids, img_f, txt_f = ids[order], img_f[order], txt_f[order]
    uniq = torch.ones_like(ids, dtype=torch.bool)
    uniq[1:] = ids[1:] != ids[:-1]
    img_f, txt_f = img_f[uniq][::5], txt_f[uniq]
    sim = img_f @ txt_f.T  # [n_img, 5 * n_img]
    txt2img = torch.arange(txt_f.size(0), device=device) // 5
    i2t_rank = torch.stack([(sim[i].argsort(descending=True) // 5 == i).nonzero()[0, 0] for i in range(sim.size(0))])
    t2i_rank = (sim.T.argsort(dim=1, descending=True) == txt2img[:, None]).float().argmax(1)
    model.train()
    return {f"{d}_R@{k}": (r < k).float().mean().item() * 100
            for d, r in (("i2t", i2t_rank), ("t2i", t2i_rank)) for k in (1, 5, 10)}


def _all_gather(t, ws):
    out = [torch.empty_like(t) for _ in range(ws)]
    dist.all_gather(out, t)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--coco-json", required=True)
    ap.add_argument("--image-root", required=True)
    ap.add_argument("--model", default="openai/clip-vit-large-patch14")
    ap.add_argument("--bs", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=500)
    ap.add_argument("--out", default="checkpoints/clip_coco")
    ap.add_argument("--run-name", default=None)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(args.seed + rank)
    torch.manual_seed(args.seed + rank)

    wandb.init(project="clip-retrieval", name=args.run_name, config={**vars(args), "world_size": world})

    processor = CLIPProcessor.from_pretrained(args.model)
    model = DDP(CLIPModel.from_pretrained(args.model).to(device), device_ids=[local_rank])
    collate = make_collate(processor)

    train_ds = CocoPairs(args.coco_json, args.image_root, "train", processor)
    test_ds = CocoPairs(args.coco_json, args.image_root, "test", processor)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_ds, batch_size=args.bs, sampler=sampler, num_workers=8,
                              collate_fn=collate, drop_last=True, pin_memory=True)
    test_loader = DataLoader(test_ds, batch_size=128, sampler=DistributedSampler(test_ds, shuffle=False),
                             num_workers=8, collate_fn=collate)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.98))
    total = args.epochs * len(train_loader)
    sched = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / args.warmup) *
                                              0.5 * (1 + math.cos(math.pi * s / total)))
    scaler = torch.cuda.amp.GradScaler()
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    best_rsum, step = 0.0, 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for pix, input_ids, attn, _ in train_loader:
            pix, input_ids, attn = pix.to(device), input_ids.to(device), attn.to(device)
            with torch.autocast("cuda", dtype=torch.float16):
                out = model(pixel_values=pix, input_ids=input_ids, attention_mask=attn)
                img = F.normalize(out.image_embeds, dim=-1)
                txt = F.normalize(out.text_embeds, dim=-1)
                loss = global_contrastive_loss(img, txt, model.module.logit_scale.exp())
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            sched.step()
            step += 1
            if step % 25 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                wandb.log({"train/loss": l.item(), "train/lr": sched.get_last_lr()[0],
                           "train/temp": model.module.logit_scale.exp().item(), "epoch": epoch}, step=step)

        metrics = retrieval_metrics(model, test_loader, device)
        rsum = sum(metrics.values())
        wandb.log({f"test/{k}": v for k, v in metrics.items()} | {"test/rsum": rsum}, step=step)
        if rank == 0:
            print(f"epoch {epoch}: " + ", ".join(f"{k} {v:.2f}" for k, v in metrics.items()))
            if rsum > best_rsum:
                best_rsum = rsum
                model.module.save_pretrained(os.path.join(args.out, "best"))
                processor.save_pretrained(os.path.join(args.out, "best"))
        dist.barrier()

    wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
