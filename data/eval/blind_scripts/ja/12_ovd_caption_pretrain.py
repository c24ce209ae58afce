"""Grounded pre-training on CC3M with pseudo boxes.

A teacher grounding model already produced boxes for the noun phrases of each
caption (pseudo_boxes.jsonl).  Here captions are parsed with spaCy, the noun
chunks are aligned with the teacher's phrases and turned into token spans, and
a student detector is trained on (image, caption, boxes, positive map).

Parsing 3M captions with spaCy takes a while, so the parsed records are cached.

    torchrun --nproc_per_node=8 12_ovd_caption_pretrain.py --cc3m /data/cc3m
"""
import argparse
import hashlib
import json
import os
import time

import spacy
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
from torchvision.models import efficientnet_v2_m, EfficientNet_V2_M_Weights
from torchvision.ops import box_convert, box_iou, generalized_box_iou, sigmoid_focal_loss
from transformers import AutoModel, AutoTokenizer


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cc3m", default="/data/cc3m")
    ap.add_argument("--pseudo", default="/data/cc3m/pseudo_boxes.jsonl")
    ap.add_argument("--cache-dir", default="/data/cache")
    ap.add_argument("--flickr-val", default="/data/mdetr_annotations/final_flickr_separateGT_val.json")
    ap.add_argument("--flickr-images", default="/data/flickr30k/images")
    ap.add_argument("--out", default="runs/cc3m_pseudo")
    ap.add_argument("--text-model", default="bert-base-uncased")
    ap.add_argument("--min-score", type=float, default=0.5)
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-4, help="per global batch of 256")
    ap.add_argument("--max-len", type=int, default=128)
    ap.add_argument("--workers", type=int, default=10)
    return ap.parse_args()


def build_records(pseudo_file, min_score):
    nlp = spacy.load("en_core_web_sm", disable=["ner", "lemmatizer"])
    with open(pseudo_file) as f:
        rows = [json.loads(l) for l in f]
    records = []
    for row, doc in zip(rows, nlp.pipe((r["caption"] for r in rows), batch_size=512)):
        chunks = {c.text.lower(): (c.start_char, c.end_char) for c in doc.noun_chunks}
        boxes, spans = [], []
        for det in row["detections"]:
            if det["score"] < min_score or det["phrase"].lower() not in chunks:
                continue
            boxes.append(det["box"])  # normalised xyxy
            spans.append(chunks[det["phrase"].lower()])
        if boxes:
            records.append({"image": row["image"], "caption": row["caption"], "boxes": boxes, "spans": spans})
    return records


def load_or_build(args):
    key = hashlib.md5(f"{args.pseudo}:{args.min_score}".encode()).hexdigest()[:10]
    cache = os.path.join(args.cache_dir, f"cc3m_grounding_{key}.pt")
    if os.path.exists(cache):
        return torch.load(cache)
    records = build_records(args.pseudo, args.min_score)
    os.makedirs(args.cache_dir, exist_ok=True)
    torch.save(records, cache)
    return records


class PseudoGrounding(Dataset):
    def __init__(self, records, root, tok, max_len):
        self.records, self.root, self.tok, self.max_len = records, root, tok, max_len
        # boxes are normalised, so a plain square resize keeps them valid
        self.tf = T.Compose([T.Resize((640, 640)), T.ToTensor(),
                             T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])

    def __len__(self):
        return len(self.records)

    def image_path(self, r):
        return os.path.join(self.root, "images", r["image"])

    def __getitem__(self, i):
        r = self.records[i]
        img = Image.open(self.image_path(r)).convert("RGB")
        enc = self.tok(r["caption"], truncation=True, max_length=self.max_len, padding="max_length")
        pm = torch.zeros(len(r["spans"]), self.max_len)
        for k, (s, e) in enumerate(r["spans"]):
            a, b = enc.char_to_token(s), enc.char_to_token(e - 1)
            if a is not None and b is not None:
                pm[k, a: b + 1] = 1
        boxes = box_convert(torch.tensor(r["boxes"], dtype=torch.float32), "xyxy", "cxcywh").clamp(0, 1)
        return (self.tf(img), torch.tensor(enc["input_ids"]), torch.tensor(enc["attention_mask"]),
                {"boxes": boxes, "positive_map": pm})


class FlickrVal(PseudoGrounding):
    """Flickr30k entities val in MDETR format, in the same record layout as the training data."""

    def __init__(self, ann, root, tok, max_len):
        with open(ann) as f:
            d = json.load(f)
        by_img = {}
        for a in d["annotations"]:
            by_img.setdefault(a["image_id"], []).append(a)
        records = []
        for im in d["images"]:
            anns = by_img.get(im["id"], [])
            if not anns:
                continue
            W, H = im["width"], im["height"]
            records.append({"image": im["file_name"], "caption": im["caption"],
                            "boxes": [[a["bbox"][0] / W, a["bbox"][1] / H, (a["bbox"][0] + a["bbox"][2]) / W,
                                       (a["bbox"][1] + a["bbox"][3]) / H] for a in anns],
                            "spans": [a["tokens_positive"][0] for a in anns]})
        super().__init__(records, root, tok, max_len)

    def image_path(self, r):
        return os.path.join(self.root, r["image"])


def collate(batch):
    imgs, ids, am, tgts = zip(*batch)
    return torch.stack(imgs), torch.stack(ids), torch.stack(am), list(tgts)


class Student(nn.Module):
    def __init__(self, text_model, d=256, nq=200):
        super().__init__()
        self.backbone = efficientnet_v2_m(weights=EfficientNet_V2_M_Weights.IMAGENET1K_V1).features
        self.vproj = nn.Conv2d(1280, d, 1)
        self.pos = nn.Parameter(torch.zeros(1, 20 * 20, d))
        self.text = AutoModel.from_pretrained(text_model, add_pooling_layer=False)
        self.tproj = nn.Linear(self.text.config.hidden_size, d)
        self.fusion = nn.TransformerEncoder(nn.TransformerEncoderLayer(d, 8, 1024, batch_first=True), 4)
        self.queries = nn.Embedding(nq, d)
        self.decoder = nn.TransformerDecoder(nn.TransformerDecoderLayer(d, 8, 1024, batch_first=True), 6)
        self.box = nn.Sequential(nn.Linear(d, d), nn.ReLU(), nn.Linear(d, 4))

    def forward(self, x, ids, am):
        v = self.vproj(self.backbone(x)).flatten(2).transpose(1, 2) + self.pos
        t = self.tproj(self.text(input_ids=ids, attention_mask=am).last_hidden_state)
        pad = ~am.bool()
        h = self.fusion(torch.cat([v, t], 1), src_key_padding_mask=torch.cat([torch.zeros_like(v[..., 0], dtype=torch.bool), pad], 1))
        v, t = h[:, : v.shape[1]], h[:, v.shape[1]:]
        q = self.decoder(self.queries.weight.expand(x.shape[0], -1, -1), v)
        logits = (q @ t.transpose(1, 2) / 16.0).masked_fill(pad[:, None], -1e4)
        return logits, self.box(q).sigmoid()


def loss_fn(logits, boxes, tgts):
    n = torch.tensor(float(sum(len(t["boxes"]) for t in tgts)), device=logits.device)
    dist.all_reduce(n)
    n = (n / dist.get_world_size()).clamp(min=1)
    tmap = torch.zeros_like(logits)
    lb = logits.new_zeros(())
    for b, t in enumerate(tgts):
        tb, pm = t["boxes"], t["positive_map"]
        with torch.no_grad():
            C = -(logits[b].sigmoid() @ (pm / pm.sum(-1, keepdim=True).clamp(min=1)).T) + 5 * torch.cdist(boxes[b], tb, p=1) \
                - 2 * generalized_box_iou(box_convert(boxes[b], "cxcywh", "xyxy"), box_convert(tb, "cxcywh", "xyxy"))
            r, c = linear_sum_assignment(C.cpu())
        tmap[b, r] = pm[c]
        lb = lb + 5 * F.l1_loss(boxes[b, r], tb[c], reduction="sum") + 2 * (1 - generalized_box_iou(
            box_convert(boxes[b, r], "cxcywh", "xyxy"), box_convert(tb[c], "cxcywh", "xyxy")).diag()).sum()
    return (sigmoid_focal_loss(logits, tmap, reduction="sum") + lb) / n


@torch.no_grad()
def flickr_recall(model, loader, device):
    """Phrase grounding R@1: the best-scoring box of each phrase must overlap its box by IoU >= 0.5."""
    model.eval()
    hits = torch.zeros(2, device=device)
    for x, ids, am, tgts in loader:
        logits, boxes = model(x.to(device), ids.to(device), am.to(device))
        for b, t in enumerate(tgts):
            pm = t["positive_map"].to(device)
            score = logits[b].sigmoid() @ (pm / pm.sum(-1, keepdim=True).clamp(min=1)).T  # Q x P
            top = boxes[b, score.argmax(0)]
            iou = box_iou(box_convert(top, "cxcywh", "xyxy"), box_convert(t["boxes"].to(device), "cxcywh", "xyxy"))
            hits += torch.stack([(iou.diag() >= 0.5).sum().float(), torch.tensor(float(len(pm)), device=device)])
    dist.all_reduce(hits)
    model.train()
    return (hits[0] / hits[1].clamp(min=1)).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    records = load_or_build(args)
    tok = AutoTokenizer.from_pretrained(args.text_model)
    ds = PseudoGrounding(records, args.cc3m, tok, args.max_len)
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    loader = DataLoader(ds, args.batch_size, sampler=sampler, num_workers=args.workers, collate_fn=collate,
                        pin_memory=True, persistent_workers=True, prefetch_factor=4)
    val_set = FlickrVal(args.flickr_val, args.flickr_images, tok, args.max_len)
    val_loader = DataLoader(Subset(val_set, range(rank, len(val_set), world)), 8, collate_fn=collate, num_workers=4)
    if rank == 0:
        print(f"{len(ds)} captions with aligned pseudo boxes, {len(loader)} iters/epoch", flush=True)

    model = Student(args.text_model).to(device)
    model = DDP(model, device_ids=[local_rank])
    lr = args.lr * args.batch_size * world / 256
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.05)
    total = args.epochs * len(loader)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=total, pct_start=0.02)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, (x, ids, am, tgts) in enumerate(loader):
            tgts = [{k: v.to(device) for k, v in t.items()} for t in tgts]
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits, boxes = model(x.to(device, non_blocking=True), ids.to(device), am.to(device))
            loss = loss_fn(logits.float(), boxes.float(), tgts)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            if it % 200 == 0:
                l = loss.detach().clone()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"epoch {epoch} it {it} loss {l.item():.4f} {(time.time() - t0) / (it + 1):.3f}s/it", flush=True)
        r1 = flickr_recall(model.module, val_loader, device)
        if rank == 0:
            print(f"epoch {epoch} flickr30k val R@1 {r1 * 100:.2f}", flush=True)
            os.makedirs(args.out, exist_ok=True)
            torch.save({"model": model.module.state_dict(), "epoch": epoch}, os.path.join(args.out, f"student_ep{epoch}.pt"))
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
