"""MDETR-style modulated detection fine-tuning on an in-house grounding set.

The annotations come as one jsonl per shard of the labelling tool: one record
per (image, caption) with boxes and the character spans they ground.  There is
no official split, so a fixed fraction is held out for validation.

    torchrun --standalone --nproc_per_node=4 05_mdetr_flickr.py --data /data/grounding_v3
"""
import argparse
import glob
import json
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision.transforms as T
from PIL import Image
from scipy.optimize import linear_sum_assignment
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision.models import resnet101, ResNet101_Weights
from torchvision.ops import box_convert, box_iou, generalized_box_iou
from torchvision.ops.misc import FrozenBatchNorm2d
from transformers import RobertaModel, RobertaTokenizerFast


def set_seed(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def parse():
    ap = argparse.ArgumentParser("mdetr finetune")
    ap.add_argument("--data", default="/data/grounding_v3")
    ap.add_argument("--img-root", default="/data/grounding_v3/images")
    ap.add_argument("--init", default="pretrained/pretrained_resnet101_checkpoint.pth")
    ap.add_argument("--output-dir", default="exps/mdetr_r101_ft")
    ap.add_argument("--val-frac", type=float, default=0.02)
    ap.add_argument("--epochs", type=int, default=15)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--lr-backbone", type=float, default=1e-5)
    ap.add_argument("--text-lr", type=float, default=1e-5)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--num-workers", type=int, default=8)
    return ap.parse_args()


def load_records(data_dir):
    records = []
    for path in sorted(glob.glob(os.path.join(data_dir, "ann_*.jsonl"))):
        with open(path) as f:
            records.extend(json.loads(line) for line in f if line.strip())
    return [r for r in records if r["boxes"]]


class GroundingRecords(Dataset):
    def __init__(self, records, img_root, tokenizer, train):
        self.records, self.img_root, self.tok, self.train = records, img_root, tokenizer, train
        self.tf = T.Compose([T.ToTensor(), T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])

    def __len__(self):
        return len(self.records)

    def __getitem__(self, i):
        r = self.records[i]
        img = Image.open(os.path.join(self.img_root, r["image"])).convert("RGB")
        w, h = img.size
        short = random.choice([480, 544, 608, 672, 736, 800]) if self.train else 800
        s = min(short / min(w, h), 1333 / max(w, h))
        img = img.resize((int(w * s), int(h * s)))
        enc = self.tok(r["caption"], truncation=True, max_length=256)
        boxes, spans = [], []
        for b in r["boxes"]:
            x0, y0, x1, y1 = b["xyxy"]
            boxes.append([x0 / w, y0 / h, x1 / w, y1 / h])
            toks = set()
            for cs, ce in b["spans"]:
                for c in range(cs, ce):
                    t = enc.char_to_token(c)
                    if t is not None:
                        toks.add(t)
            spans.append(sorted(toks))
        boxes = box_convert(torch.tensor(boxes, dtype=torch.float32), "xyxy", "cxcywh")
        return self.tf(img), r["caption"], {"boxes": boxes, "spans": spans}


def collate(batch):
    imgs, caps, tgts = zip(*batch)
    H, W = max(i.shape[1] for i in imgs), max(i.shape[2] for i in imgs)
    x = torch.zeros(len(imgs), 3, H, W)
    for k, im in enumerate(imgs):
        x[k, :, : im.shape[1], : im.shape[2]] = im
    return x, list(caps), list(tgts)


class MDETR(nn.Module):
    def __init__(self, d=256, num_queries=100):
        super().__init__()
        r = resnet101(weights=ResNet101_Weights.IMAGENET1K_V2, norm_layer=FrozenBatchNorm2d)
        self.backbone = nn.Sequential(*list(r.children())[:-2])
        self.input_proj = nn.Conv2d(2048, d, 1)
        self.text_encoder = RobertaModel.from_pretrained("roberta-base", add_pooling_layer=False)
        self.resizer = nn.Sequential(nn.Linear(768, d), nn.LayerNorm(d), nn.Dropout(0.1))
        self.transformer = nn.Transformer(d, 8, 6, 6, 2048, batch_first=True)
        self.query_embed = nn.Embedding(num_queries, d)
        self.bbox_embed = nn.Sequential(nn.Linear(d, d), nn.ReLU(), nn.Linear(d, 4))
        self.contrastive_img = nn.Linear(d, 64)
        self.contrastive_txt = nn.Linear(d, 64)
        self.row = nn.Embedding(64, d // 2)
        self.col = nn.Embedding(64, d // 2)

    def forward(self, images, input_ids, attention_mask):
        f = self.input_proj(self.backbone(images))
        B, D, h, w = f.shape
        pos = torch.cat([self.col.weight[:w][None].expand(h, -1, -1), self.row.weight[:h][:, None].expand(-1, w, -1)], -1)
        img = f.flatten(2).transpose(1, 2) + pos.flatten(0, 1)[None]
        txt = self.resizer(self.text_encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state)
        src = torch.cat([img, txt], 1)
        pad = torch.cat([torch.zeros(B, img.shape[1], dtype=torch.bool, device=img.device), ~attention_mask.bool()], 1)
        hs = self.transformer(src, self.query_embed.weight.expand(B, -1, -1), src_key_padding_mask=pad,
                              memory_key_padding_mask=pad)
        mem_txt = self.transformer.encoder(src, src_key_padding_mask=pad)[:, img.shape[1]:]
        q = F.normalize(self.contrastive_img(hs), dim=-1)
        t = F.normalize(self.contrastive_txt(mem_txt), dim=-1)
        align = (q @ t.transpose(1, 2)) / 0.07
        align = align.masked_fill(~attention_mask.bool()[:, None], -1e4)
        return align, self.bbox_embed(hs).sigmoid()


def mdetr_loss(align, boxes, targets):
    total = align.new_zeros(())
    n = max(sum(len(t["boxes"]) for t in targets), 1)
    for b, t in enumerate(targets):
        tb = t["boxes"].to(align.device)
        span_mask = torch.zeros(len(tb), align.shape[-1], device=align.device)
        for k, s in enumerate(t["spans"]):
            span_mask[k, s] = 1
        logp = align[b].log_softmax(-1)
        with torch.no_grad():
            cost = -(logp.exp() @ (span_mask / span_mask.sum(-1, keepdim=True).clamp(min=1)).T) \
                + 5 * torch.cdist(boxes[b], tb, p=1) \
                - 2 * generalized_box_iou(box_convert(boxes[b], "cxcywh", "xyxy"), box_convert(tb, "cxcywh", "xyxy"))
            qi, ti = linear_sum_assignment(cost.cpu())
        # soft token prediction: matched queries put mass on their tokens, the rest on the last token ("no object")
        tgt = torch.zeros_like(logp)
        tgt[:, -1] = 1
        tgt[qi] = span_mask[ti] / span_mask[ti].sum(-1, keepdim=True).clamp(min=1)
        total = total + -(tgt * logp).sum(-1).mean() * len(tb)
        pb, gb = boxes[b, qi], tb[ti]
        total = total + 5 * F.l1_loss(pb, gb, reduction="sum") + 2 * (
            1 - generalized_box_iou(box_convert(pb, "cxcywh", "xyxy"), box_convert(gb, "cxcywh", "xyxy")).diag()).sum()
    return total / n


@torch.no_grad()
def validate(model, loader, tok, device):
    model.eval()
    correct = total = 0
    for images, caps, tgts in loader:
        enc = tok(caps, padding="longest", return_tensors="pt").to(device)
        align, boxes = model(images.to(device), enc.input_ids, enc.attention_mask)
        prob = align.softmax(-1)
        for b, t in enumerate(tgts):
            for k, s in enumerate(t["spans"]):
                score = prob[b][:, s].sum(-1)
                pred = box_convert(boxes[b, score.argmax()][None], "cxcywh", "xyxy")
                gt = box_convert(t["boxes"][k][None].to(device), "cxcywh", "xyxy")
                correct += int(box_iou(pred, gt).item() >= 0.5)
                total += 1
    out = torch.tensor([correct, total], device=device, dtype=torch.float64)
    dist.all_reduce(out)
    model.train()
    return (out[0] / out[1].clamp(min=1)).item()


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    set_seed(args.seed + rank)  # decorrelate augmentation across ranks

    tok = RobertaTokenizerFast.from_pretrained("roberta-base")
    records = load_records(args.data)
    random.shuffle(records)
    n_val = int(len(records) * args.val_frac)
    val_records, train_records = records[:n_val], records[n_val:]
    train_set = GroundingRecords(train_records, args.img_root, tok, train=True)
    val_set = GroundingRecords(val_records, args.img_root, tok, train=False)
    if rank == 0:
        print(f"{len(train_set)} train / {len(val_set)} val records", flush=True)

    sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_set, args.batch_size, sampler=sampler, collate_fn=collate,
                              num_workers=args.num_workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(Subset(val_set, range(rank, len(val_set), world)), args.batch_size,
                            collate_fn=collate, num_workers=2)

    model = MDETR().to(device)
    if os.path.isfile(args.init):
        sd = torch.load(args.init, map_location="cpu")["model"]
        model.load_state_dict(sd, strict=False)
    ddp = DDP(model, device_ids=[local_rank])
    groups = [
        {"params": [p for n, p in model.named_parameters() if n.startswith("backbone")], "lr": args.lr_backbone},
        {"params": [p for n, p in model.named_parameters() if n.startswith("text_encoder")], "lr": args.text_lr},
        {"params": [p for n, p in model.named_parameters()
                    if not n.startswith(("backbone", "text_encoder"))], "lr": args.lr},
    ]
    opt = torch.optim.AdamW(groups, weight_decay=1e-4)
    warmup = 500
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * (1 - s / (args.epochs * len(train_loader))))

    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        ddp.train()
        tic = time.time()
        running = torch.zeros(2, device=device)
        for images, caps, tgts in train_loader:
            enc = tok(caps, padding="longest", return_tensors="pt").to(device)
            align, boxes = ddp(images.to(device, non_blocking=True), enc.input_ids, enc.attention_mask)
            loss = mdetr_loss(align, boxes, tgts)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(ddp.parameters(), 0.1)
            opt.step()
            sched.step()
            running += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(running)
        acc = validate(model, val_loader, tok, device)
        if rank == 0:
            print(f"epoch {epoch} loss {running[0] / running[1]:.4f} val acc@0.5 {acc * 100:.2f} "
                  f"({time.time() - tic:.0f}s)", flush=True)
            os.makedirs(args.output_dir, exist_ok=True)
            state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": epoch, "args": vars(args)}
            torch.save(state, os.path.join(args.output_dir, "checkpoint.pth"))
            if acc > best:
                best = acc
                torch.save(state, os.path.join(args.output_dir, "best.pth"))
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
