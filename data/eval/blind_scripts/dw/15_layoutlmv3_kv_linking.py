"""Forms understanding: entity tagging (question/answer/header) + key->value linking on a
shared LayoutLMv3 encoder. Annotations come from the forms labelling project (FUNSD schema):
each page JSON has words, boxes (0..1000), BIO tags and a list of links between entity
first-word indices.

    torchrun --nproc_per_node=8 15_layoutlmv3_kv_linking.py --data /data/forms/v5 --out /data/forms/runs/kv_v5
"""
import argparse
import glob
import json
import logging
import os
import random

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from transformers import LayoutLMv3Model, LayoutLMv3Processor, get_linear_schedule_with_warmup

log = logging.getLogger("kv")
TAGS = ["O", "B-HEADER", "I-HEADER", "B-QUESTION", "I-QUESTION", "B-ANSWER", "I-ANSWER"]


class FormPages(Dataset):
    def __init__(self, folder, processor, max_length=512):
        self.files = sorted(glob.glob(os.path.join(folder, "*.json")))
        self.processor = processor
        self.max_length = max_length

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        with open(self.files[i]) as fh:
            page = json.load(fh)
        image = Image.open(page["image_path"]).convert("RGB")
        enc = self.processor(image, page["words"], boxes=page["boxes"],
                             word_labels=[TAGS.index(t) for t in page["tags"]], truncation=True,
                             padding="max_length", max_length=self.max_length, return_tensors="pt")
        # map word index -> first sub-token position, for the links
        first_tok = {}
        for pos, w in enumerate(enc.word_ids(0)):
            if w is not None and w not in first_tok:
                first_tok[w] = pos
        links = [(first_tok[h], first_tok[t]) for h, t in page["links"] if h in first_tok and t in first_tok]
        item = {k: v[0] for k, v in enc.items()}
        item["links"] = torch.tensor(links, dtype=torch.long).reshape(-1, 2)
        return item


def collate(items):
    out = {k: torch.stack([it[k] for it in items]) for k in items[0] if k != "links"}
    out["links"] = torch.cat([torch.cat([torch.full((len(it["links"]), 1), b), it["links"]], dim=1)
                              for b, it in enumerate(items)]) if items else torch.empty(0, 3, dtype=torch.long)
    return out


class FormModel(nn.Module):
    def __init__(self, backbone, n_tags, link_dim=256):
        super().__init__()
        self.encoder = LayoutLMv3Model.from_pretrained(backbone)
        h = self.encoder.config.hidden_size
        self.tagger = nn.Sequential(nn.Dropout(0.1), nn.Linear(h, n_tags))
        self.head_proj = nn.Sequential(nn.Linear(h, link_dim), nn.GELU())
        self.tail_proj = nn.Sequential(nn.Linear(h, link_dim), nn.GELU())
        self.link_bilinear = nn.Bilinear(link_dim, link_dim, 1)

    def forward(self, input_ids, bbox, attention_mask, pixel_values, labels, links):
        seq = self.encoder(input_ids=input_ids, bbox=bbox, attention_mask=attention_mask,
                           pixel_values=pixel_values).last_hidden_state[:, : input_ids.shape[1]]
        tag_logits = self.tagger(seq)
        loss = F.cross_entropy(tag_logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
        link_loss = torch.zeros((), device=seq.device)
        if links.numel() > 0:
            b, h, t = links.unbind(1)
            # negatives: same head, random tail position inside the page
            neg_t = torch.randint_like(t, 1, input_ids.shape[1] - 1)
            heads = self.head_proj(seq[b, h])
            pos = self.link_bilinear(heads, self.tail_proj(seq[b, t])).squeeze(-1)
            neg = self.link_bilinear(heads, self.tail_proj(seq[b, neg_t])).squeeze(-1)
            logits = torch.cat([pos, neg])
            target = torch.cat([torch.ones_like(pos), torch.zeros_like(neg)])
            link_loss = F.binary_cross_entropy_with_logits(logits, target)
        return loss + link_loss, tag_logits, link_loss.detach()


@torch.no_grad()
def tag_accuracy(model, loader, device):
    model.eval()
    acc = torch.zeros(2, device=device)
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        _, logits, _ = model(**batch)
        keep = batch["labels"] != -100
        acc[0] += (logits.argmax(-1)[keep] == batch["labels"][keep]).sum()
        acc[1] += keep.sum()
    dist.all_reduce(acc)
    model.train()
    return (acc[0] / acc[1].clamp(min=1)).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--backbone", default="microsoft/layoutlmv3-base")
    ap.add_argument("--bs", type=int, default=4)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--epochs", type=int, default=25)
    ap.add_argument("--seed", type=int, default=5)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")

    processor = LayoutLMv3Processor.from_pretrained(args.backbone, apply_ocr=False)
    train_ds = FormPages(os.path.join(args.data, "train"), processor)
    val_ds = FormPages(os.path.join(args.data, "val"), processor)
    sampler = DistributedSampler(train_ds, shuffle=True)
    train_dl = DataLoader(train_ds, batch_size=args.bs, sampler=sampler, collate_fn=collate,
                          num_workers=6, pin_memory=True, drop_last=True)
    val_dl = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), batch_size=8,
                        collate_fn=collate, num_workers=2)

    model = FormModel(args.backbone, len(TAGS)).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total = args.epochs * len(train_dl)
    scheduler = get_linear_schedule_with_warmup(optimizer, int(0.1 * total), total)

    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for step, batch in enumerate(train_dl):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss, _, link_loss = model(**batch)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            if rank == 0 and step % 50 == 0:
                log.info("epoch %d step %d loss %.4f link %.4f", epoch, step, loss.item(), link_loss.item())

        acc = tag_accuracy(model.module, val_dl, device)
        if rank == 0:
            log.info("epoch %d val tag acc %.4f", epoch, acc)
            if acc > best:
                best = acc
                os.makedirs(args.out, exist_ok=True)
                torch.save(model.module.state_dict(), os.path.join(args.out, "best.pt"))
                processor.save_pretrained(args.out)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
