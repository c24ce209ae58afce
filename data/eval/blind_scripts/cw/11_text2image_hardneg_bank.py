"""Title -> image product search with hard negatives mined from an embedding bank.

At the start of each epoch the whole training catalog is embedded (images and titles, every
rank embeds its shard). During the epoch each title gets its nearest non-matching images from
the image bank as extra negatives on top of the in-batch images gathered from all ranks.

torchrun --nproc_per_node=8 11_text2image_hardneg_bank.py --train data/listings_train.jsonl \
    --val data/listings_val.jsonl --images /mnt/listings --out ckpt/t2i_hn
"""
import argparse
import json
import os
import time

import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms as T
from transformers import AutoModel, AutoTokenizer


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", required=True)
    ap.add_argument("--val", required=True)
    ap.add_argument("--images", required=True)
    ap.add_argument("--out", default="ckpt/t2i_hn")
    ap.add_argument("--vision", default="vit_small_patch16_224.augreg_in21k_ft_in1k")
    ap.add_argument("--text", default="sentence-transformers/all-MiniLM-L12-v2")
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--batch-size", type=int, default=128, help="per GPU")
    ap.add_argument("--lr", type=float, default=5e-5, help="for a global batch of 1024")
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--hard-k", type=int, default=32)
    ap.add_argument("--fn-threshold", type=float, default=0.92, help="candidates above this are likely duplicates")
    ap.add_argument("--tau", type=float, default=0.03)
    ap.add_argument("--workers", type=int, default=8)
    return ap.parse_args()


class Listings(Dataset):
    def __init__(self, path, root, tf):
        with open(path) as f:
            self.rows = [json.loads(l) for l in f]
        self.root, self.tf = root, tf
        self.pids = torch.tensor([r["product_id"] for r in self.rows])

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        img = self.tf(Image.open(os.path.join(self.root, r["image"])).convert("RGB"))
        return img, r["title"], i


class DualEncoder(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.vision = timm.create_model(args.vision, pretrained=True, num_classes=0)
        self.text = AutoModel.from_pretrained(args.text, add_pooling_layer=False)
        self.img_proj = nn.Linear(self.vision.num_features, args.dim)
        self.txt_proj = nn.Linear(self.text.config.hidden_size, args.dim)

    def embed_image(self, x):
        return F.normalize(self.img_proj(self.vision(x)), dim=-1)

    def embed_text(self, ids, mask):
        h = self.text(input_ids=ids, attention_mask=mask).last_hidden_state
        pooled = (h * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
        return F.normalize(self.txt_proj(pooled), dim=-1)

    def forward(self, x, ids, mask):
        return self.embed_image(x), self.embed_text(ids, mask)


@torch.no_grad()
def gather(t):
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return torch.cat(out)


def make_collate(tok, max_len=48):
    def collate(batch):
        imgs, titles, idx = zip(*batch)
        enc = tok(list(titles), padding=True, truncation=True, max_length=max_len, return_tensors="pt")
        return torch.stack(imgs), enc["input_ids"], enc["attention_mask"], torch.tensor(idx)
    return collate


@torch.no_grad()
def build_banks(model, ds, collate, device, workers):
    """Image and title embeddings for the whole dataset, identical on every rank."""
    model.eval()
    loader = DataLoader(ds, batch_size=256, sampler=DistributedSampler(ds, shuffle=False),
                        num_workers=workers, collate_fn=collate)
    ie, te, ix = [], [], []
    for x, ids, mask, idx in loader:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            i, t = model(x.to(device), ids.to(device), mask.to(device))
        ie.append(i.float())
        te.append(t.float())
        ix.append(idx.to(device))
    ie, te, ix = gather(torch.cat(ie)), gather(torch.cat(te)), gather(torch.cat(ix))
    img_bank = torch.zeros(len(ds), ie.shape[1], device=device)
    txt_bank = torch.zeros_like(img_bank)
    img_bank[ix], txt_bank[ix] = ie, te
    model.train()
    return img_bank, txt_bank


@torch.no_grad()
def mine_hard(txt_bank, img_bank, pids, idx, k, thr):
    sim = txt_bank[idx] @ img_bank.T
    top_sim, top_idx = sim.topk(k, dim=1)
    ok = (pids[top_idx] != pids[idx][:, None]) & (top_sim < thr)
    return top_idx, ok


@torch.no_grad()
def recall_t2i(model, ds, collate, device, workers, ks=(1, 5, 10)):
    img_bank, txt_bank = build_banks(model, ds, collate, device, workers)
    pids = ds.pids.to(device)
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = torch.arange(rank, len(ds), world, device=device)
    top = (txt_bank[mine] @ img_bank.T).topk(max(ks), dim=1).indices
    hit = pids[top] == pids[mine][:, None]
    c = torch.stack([hit[:, :k].any(1).sum() for k in ks] + [torch.tensor(len(mine), device=device)]).double()
    dist.all_reduce(c)
    return {f"R@{k}": (100 * c[j] / c[-1]).item() for j, k in enumerate(ks)}


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    tok = AutoTokenizer.from_pretrained(args.text)
    collate = make_collate(tok)
    norm = T.Normalize([0.5] * 3, [0.5] * 3)
    tr = T.Compose([T.RandomResizedCrop(224, scale=(0.5, 1.0)), T.RandomHorizontalFlip(), T.ToTensor(), norm])
    te = T.Compose([T.Resize(224), T.CenterCrop(224), T.ToTensor(), norm])
    train_ds = Listings(args.train, args.images, tr)
    bank_ds = Listings(args.train, args.images, te)
    val_ds = Listings(args.val, args.images, te)
    pids = train_ds.pids.to(device)

    sampler = DistributedSampler(train_ds, shuffle=True)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        collate_fn=collate, pin_memory=True, drop_last=True)

    model = DualEncoder(args).to(device)
    ddp = DDP(model, device_ids=[local_rank])
    lr = args.lr * args.batch_size * world / 1024
    opt = torch.optim.AdamW(ddp.parameters(), lr=lr, weight_decay=0.05)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(loader))

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best = 0.0
    for epoch in range(args.epochs):
        img_bank, txt_bank = build_banks(model, bank_ds, collate, device, args.workers)
        sampler.set_epoch(epoch)
        ddp.train()
        t0, n_skipped = time.time(), 0
        for step, (x, ids, mask, idx) in enumerate(loader):
            idx = idx.to(device)
            hard_idx, ok = mine_hard(txt_bank, img_bank, pids, idx, args.hard_k, args.fn_threshold)
            if not ok.any():
                n_skipped += 1
                continue
            x, ids, mask = x.to(device, non_blocking=True), ids.to(device), mask.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                img_e, txt_e = ddp(x, ids, mask)
            img_e, txt_e = img_e.float(), txt_e.float()

            n = txt_e.shape[0]
            all_img = gather(img_e.detach())
            all_img[rank * n:(rank + 1) * n] = img_e  # keep the gradient for this rank's images
            logits_b = txt_e @ all_img.T / args.tau
            hard = img_bank[hard_idx]  # [n, k, d], from the bank, no gradient
            logits_h = torch.einsum("nd,nkd->nk", txt_e, hard) / args.tau
            logits_h = logits_h.masked_fill(~ok, -1e4)
            logits = torch.cat([logits_b, logits_h], dim=1)
            target = torch.arange(n, device=device) + rank * n
            loss_t2i = F.cross_entropy(logits, target)
            loss_i2t = F.cross_entropy(img_e @ gather(txt_e.detach()).T / args.tau, target)
            loss = 0.5 * (loss_t2i + loss_i2t)

            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            if rank == 0 and step % 100 == 0:
                print(f"ep {epoch} step {step} loss {loss.item():.4f} skipped {n_skipped}", flush=True)

        ddp.eval()
        rec = recall_t2i(model, val_ds, collate, device, args.workers)
        if rank == 0:
            print(f"epoch {epoch} {time.time() - t0:.0f}s " + " ".join(f"{k}={v:.2f}" for k, v in rec.items()),
                  flush=True)
            if rec["R@1"] > best:
                best = rec["R@1"]
                torch.save({"model": model.state_dict(), "epoch": epoch, "recall": rec},
                           os.path.join(args.out, "best.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
