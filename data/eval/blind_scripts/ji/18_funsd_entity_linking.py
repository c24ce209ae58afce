"""Entity linking (question -> answer relations) on FUNSD with a LayoutLMv3 encoder and a biaffine scorer.

Gold entities are given; the model decides which question/answer pairs are linked.

    torchrun --nproc_per_node=4 18_funsd_entity_linking.py --funsd_dir /data/FUNSD/dataset
"""
import argparse
import glob
import json
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import LayoutLMv3Model, LayoutLMv3Processor

ENT_TYPES = {"header": 0, "question": 1, "answer": 2, "other": 3}
MAX_ENT = 128


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--funsd_dir", required=True)
    ap.add_argument("--model", default="microsoft/layoutlmv3-base")
    ap.add_argument("--epochs", type=int, default=60)
    ap.add_argument("--bs", type=int, default=2)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--head_lr", type=float, default=5e-4)
    ap.add_argument("--out", default="runs/funsd_re")
    ap.add_argument("--local_rank", type=int, default=0)
    return ap.parse_args()


def load_split(root, split):
    docs = []
    for path in sorted(glob.glob(os.path.join(root, f"{split}ing_data", "annotations", "*.json"))):
        stem = os.path.splitext(os.path.basename(path))[0]
        with open(path) as f:
            form = json.load(f)["form"]
        img = os.path.join(root, f"{split}ing_data", "images", stem + ".png")
        docs.append((img, form))
    return docs


class FunsdLinks(Dataset):
    def __init__(self, docs, processor):
        self.items = []
        for img_path, form in docs:
            image = Image.open(img_path).convert("RGB")
            w, h = image.size
            words, boxes, word_ent = [], [], []
            ents = [e for e in form if e["words"]][:MAX_ENT]
            id2pos = {e["id"]: k for k, e in enumerate(ents)}
            for k, e in enumerate(ents):
                for wd in e["words"]:
                    if not wd["text"].strip():
                        continue
                    x0, y0, x1, y1 = wd["box"]
                    words.append(wd["text"])
                    boxes.append([int(1000 * x0 / w), int(1000 * y0 / h), int(1000 * x1 / w), int(1000 * y1 / h)])
                    word_ent.append(k)
            enc = processor(image, words, boxes=boxes, truncation=True, max_length=512,
                            padding="max_length", return_tensors="pt")
            first_tok = torch.full((MAX_ENT,), -1, dtype=torch.long)
            for t, wid in enumerate(enc.word_ids(0)):
                if wid is not None and first_tok[word_ent[wid]] < 0:
                    first_tok[word_ent[wid]] = t
            types = torch.full((MAX_ENT,), 3, dtype=torch.long)
            links = torch.zeros(MAX_ENT, MAX_ENT)
            for k, e in enumerate(ents):
                types[k] = ENT_TYPES[e["label"]]
                for a, b in e["linking"]:
                    if a in id2pos and b in id2pos:
                        qa = (id2pos[a], id2pos[b]) if ents[id2pos[a]]["label"] == "question" else (id2pos[b], id2pos[a])
                        links[qa] = 1.0
            cand = (types[:, None] == 1) & (types[None, :] == 2) & (first_tok[:, None] >= 0) & (first_tok[None, :] >= 0)
            if cand.sum() == 0:
                continue
            item = {k: v[0] for k, v in enc.items()}
            item.update(first_tok=first_tok, types=types, links=links, cand=cand)
            self.items.append(item)

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


class LinkModel(nn.Module):
    def __init__(self, name, dim=256):
        super().__init__()
        self.encoder = LayoutLMv3Model.from_pretrained(name)
        hid = self.encoder.config.hidden_size
        self.type_emb = nn.Embedding(len(ENT_TYPES), hid)
        self.head = nn.Sequential(nn.Linear(hid, dim), nn.GELU(), nn.Dropout(0.1))
        self.tail = nn.Sequential(nn.Linear(hid, dim), nn.GELU(), nn.Dropout(0.1))
        self.bilinear = nn.Parameter(torch.zeros(dim, dim))
        self.head_bias = nn.Linear(dim, 1)

    def forward(self, input_ids, bbox, attention_mask, pixel_values, first_tok, types):
        seq = self.encoder(input_ids=input_ids, bbox=bbox, attention_mask=attention_mask,
                           pixel_values=pixel_values).last_hidden_state
        idx = first_tok.clamp(min=0)
        ent = torch.gather(seq, 1, idx[..., None].expand(-1, -1, seq.size(-1))) + self.type_emb(types)
        h, t = self.head(ent), self.tail(ent)
        return torch.einsum("bid,de,bje->bij", h, self.bilinear, t) + self.head_bias(h)


def run_epoch_eval(model, loader, device):
    model.eval()
    stats = torch.zeros(3, device=device)
    with torch.no_grad():
        for batch in loader:
            batch = {k: v.to(device) for k, v in batch.items()}
            scores = model(batch["input_ids"], batch["bbox"], batch["attention_mask"], batch["pixel_values"],
                           batch["first_tok"], batch["types"])
            pred = (scores > 0) & batch["cand"]
            gold = batch["links"].bool() & batch["cand"]
            stats += torch.stack([(pred & gold).sum(), (pred & ~gold).sum(), (~pred & gold).sum()]).float()
    dist.all_reduce(stats)
    model.train()
    tp, fp, fn = stats.tolist()
    return 2 * tp / max(2 * tp + fp + fn, 1)


def main():
    args = parse_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", args.local_rank)

    processor = LayoutLMv3Processor.from_pretrained(args.model, apply_ocr=False)
    train_ds = FunsdLinks(load_split(args.funsd_dir, "train"), processor)
    test_ds = FunsdLinks(load_split(args.funsd_dir, "test"), processor)
    sampler = DistributedSampler(train_ds, shuffle=True)
    train_dl = DataLoader(train_ds, batch_size=args.bs, sampler=sampler, drop_last=True)
    test_dl = DataLoader(torch.utils.data.Subset(test_ds, range(rank, len(test_ds), world)), batch_size=args.bs)

    model = LinkModel(args.model).to(device)
    model = DDP(model, device_ids=[args.local_rank], output_device=args.local_rank)
    enc_params = [p for n, p in model.module.named_parameters() if n.startswith("encoder.")]
    head_params = [p for n, p in model.module.named_parameters() if not n.startswith("encoder.")]
    optimizer = torch.optim.AdamW([{"params": enc_params, "lr": args.lr},
                                   {"params": head_params, "lr": args.head_lr}], weight_decay=0.01)
    total = args.epochs * len(train_dl)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 200) * (1 - s / total))

    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for batch in train_dl:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            scores = model(batch["input_ids"], batch["bbox"], batch["attention_mask"], batch["pixel_values"],
                           batch["first_tok"], batch["types"])
            cand = batch["cand"]
            pos = batch["links"][cand].sum().clamp(min=1)
            neg = cand.sum() - pos
            loss = F.binary_cross_entropy_with_logits(scores[cand], batch["links"][cand],
                                                      pos_weight=(neg / pos).clamp(max=20.0))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()

        if epoch % 5 == 4 or epoch == args.epochs - 1:
            f1 = run_epoch_eval(model.module, test_dl, device)
            if rank == 0:
                print(f"epoch {epoch} loss {loss.item():.4f} link F1 {f1:.4f}", flush=True)
                if f1 > best:
                    best = f1
                    os.makedirs(args.out, exist_ok=True)
                    torch.save(model.module.state_dict(), os.path.join(args.out, "best_linker.pt"))

    if rank == 0:
        print(f"best link F1 {best:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
