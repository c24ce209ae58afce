"""Dual-encoder CLIP with a timm ViT image tower and a pretrained BERT text tower.

Trained on CC12M-style TSV (image_path \t caption); evaluated with image->text / text->image
retrieval on the Flickr30k 1k test split.
"""
import argparse
import csv
import math
import os
import time

import numpy as np
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from timm.data import create_transform, resolve_data_config
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModel, AutoTokenizer


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--train-tsv", required=True)
    p.add_argument("--flickr-test", required=True, help="tsv: image_path \\t caption (5 per image)")
    p.add_argument("--image-root", default="/data")
    p.add_argument("--vision", default="vit_base_patch16_224.augreg_in21k")
    p.add_argument("--text", default="bert-base-uncased")
    p.add_argument("--embed-dim", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--text-lr", type=float, default=3e-5)
    p.add_argument("--max-text-len", type=int, default=64)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--out", default="runs/vit_bert_clip")
    return p.parse_args()


class TsvPairs(Dataset):
    def __init__(self, path, image_root, transform):
        with open(path, newline="") as f:
            self.rows = [r for r in csv.reader(f, delimiter="\t") if len(r) >= 2]
        self.image_root = image_root
        self.transform = transform

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        path, caption = self.rows[i][0], self.rows[i][1]
        img = Image.open(os.path.join(self.image_root, path)).convert("RGB")
        return self.transform(img), caption


class TextCollate:
    def __init__(self, tokenizer, max_len):
        self.tokenizer = tokenizer
        self.max_len = max_len

    def __call__(self, batch):
        images, captions = zip(*batch)
        tok = self.tokenizer(list(captions), padding="max_length", truncation=True,
                             max_length=self.max_len, return_tensors="pt")
        return torch.stack(images), tok["input_ids"], tok["attention_mask"]


class DualEncoder(nn.Module):
    def __init__(self, vision_name, text_name, embed_dim):
        super().__init__()
        self.visual = timm.create_model(vision_name, pretrained=True, num_classes=0)
        self.text = AutoModel.from_pretrained(text_name)
        self.image_proj = nn.Linear(self.visual.num_features, embed_dim, bias=False)
        self.text_proj = nn.Linear(self.text.config.hidden_size, embed_dim, bias=False)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))

    def encode_image(self, images):
        return F.normalize(self.image_proj(self.visual(images)), dim=-1)

    def encode_text(self, input_ids, attention_mask):
        hidden = self.text(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return F.normalize(self.text_proj(hidden[:, 0]), dim=-1)

    def forward(self, images, input_ids, attention_mask):
        return self.encode_image(images), self.encode_text(input_ids, attention_mask), self.logit_scale.exp()


class GatherLayer(torch.autograd.Function):
    """all_gather that passes gradients back to the rank that produced each slice."""

    @staticmethod
    def forward(ctx, x):
        out = [torch.zeros_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(out, x)
        return tuple(out)

    @staticmethod
    def backward(ctx, *grads):
        all_grads = torch.stack(grads)
        dist.all_reduce(all_grads)
        return all_grads[dist.get_rank()]


def contrastive_loss(img, txt, scale):
    rank = dist.get_rank()
    all_img = torch.cat(GatherLayer.apply(img))
    all_txt = torch.cat(GatherLayer.apply(txt))
    labels = torch.arange(img.shape[0], device=img.device) + rank * img.shape[0]
    loss_i = F.cross_entropy(scale * img @ all_txt.t(), labels)
    loss_t = F.cross_entropy(scale * txt @ all_img.t(), labels)
    return (loss_i + loss_t) / 2


@torch.no_grad()
def flickr_retrieval(model, tokenizer, rows, transform, image_root, device, max_len):
    """Run on rank 0 only; 1000 images / 5000 captions."""
    model.eval()
    images = sorted({r[0] for r in rows})
    img_index = {p: i for i, p in enumerate(images)}
    caps = [r[1] for r in rows]
    txt2img = np.array([img_index[r[0]] for r in rows])
    img_feats = []
    for s in range(0, len(images), 128):
        batch = torch.stack([transform(Image.open(os.path.join(image_root, p)).convert("RGB"))
                             for p in images[s:s + 128]]).to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            img_feats.append(model.encode_image(batch).float())
    txt_feats = []
    for s in range(0, len(caps), 256):
        tok = tokenizer(caps[s:s + 256], padding="max_length", truncation=True, max_length=max_len,
                        return_tensors="pt").to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            txt_feats.append(model.encode_text(tok["input_ids"], tok["attention_mask"]).float())
    sim = (torch.cat(img_feats) @ torch.cat(txt_feats).t()).cpu().numpy()

    ranks_t2i = np.array([np.where(np.argsort(-sim[:, j]) == txt2img[j])[0][0] for j in range(sim.shape[1])])
    ranks_i2t = []
    for i in range(sim.shape[0]):
        order = np.argsort(-sim[i])
        ranks_i2t.append(min(np.where(order == j)[0][0] for j in np.where(txt2img == i)[0]))
    ranks_i2t = np.array(ranks_i2t)
    model.train()
    return {f"i2t_R@{k}": float((ranks_i2t < k).mean()) for k in (1, 5, 10)} | \
           {f"t2i_R@{k}": float((ranks_t2i < k).mean()) for k in (1, 5, 10)}


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    model = DualEncoder(args.vision, args.text, args.embed_dim)
    data_cfg = resolve_data_config({}, model=model.visual)
    train_tf = create_transform(**data_cfg, is_training=True, auto_augment=None)
    eval_tf = create_transform(**data_cfg, is_training=False)
    tokenizer = AutoTokenizer.from_pretrained(args.text)

    model = DDP(model.to(device), device_ids=[local_rank])

    ds = TsvPairs(args.train_tsv, args.image_root, train_tf)
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        collate_fn=TextCollate(tokenizer, args.max_text_len), pin_memory=True,
                        drop_last=True)
    with open(args.flickr_test, newline="") as f:
        flickr_rows = [r for r in csv.reader(f, delimiter="\t") if len(r) >= 2]

    text_params = [p for n, p in model.module.named_parameters() if n.startswith("text.")]
    other_params = [p for n, p in model.module.named_parameters() if not n.startswith("text.")]
    optimizer = torch.optim.AdamW([{"params": other_params, "lr": args.lr},
                                   {"params": text_params, "lr": args.text_lr}], weight_decay=0.1)
    total_steps = args.epochs * len(loader)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=[args.lr, args.text_lr], total_steps=total_steps, pct_start=0.05,
        anneal_strategy="cos")

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, (images, input_ids, attn) in enumerate(loader):
            images = images.to(device, non_blocking=True)
            input_ids = input_ids.to(device, non_blocking=True)
            attn = attn.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                img, txt, scale = model(images, input_ids, attn)
            loss = contrastive_loss(img.float(), txt.float(), scale.float())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            with torch.no_grad():
                model.module.logit_scale.clamp_(0, math.log(100))
            if rank == 0 and it % 100 == 0:
                print(f"epoch {epoch} it {it}/{len(loader)} loss {loss.item():.4f} "
                      f"T={1 / scale.item():.4f} {time.time() - t0:.0f}s", flush=True)

        if rank == 0:
            metrics = flickr_retrieval(model.module, tokenizer, flickr_rows, eval_tf, args.image_root,
                                       device, args.max_text_len)
            print(f"epoch {epoch} flickr1k: " + " ".join(f"{k}={v:.3f}" for k, v in metrics.items()),
                  flush=True)
            torch.save({"model": model.module.state_dict(), "epoch": epoch},
                       os.path.join(args.out, "last.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
