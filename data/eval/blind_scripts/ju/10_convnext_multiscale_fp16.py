"""ConvNeXt-T multi-scale features + Transformer decoder, fp16 training on V100s.

    torchrun --nproc_per_node=8 10_convnext_multiscale_fp16.py --data data/chexpert_plus --epochs 15
"""
import argparse
import json
import logging
import math
import os

import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.cuda.amp import GradScaler, autocast
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms
from transformers import AutoTokenizer

logging.basicConfig(format="%(asctime)s [%(levelname)s] %(message)s", level=logging.INFO)
logger = logging.getLogger("cxr")


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="data/chexpert_plus")
    p.add_argument("--tokenizer", default="StanfordAIMI/RadBERT")
    p.add_argument("--save", default="ckpt/convnext_fp16")
    p.add_argument("--img", type=int, default=320)
    p.add_argument("--max-len", type=int, default=128)
    p.add_argument("--bs", type=int, default=24)
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--wd", type=float, default=0.05)
    p.add_argument("--warmup", type=float, default=0.03)
    return p.parse_args()


class CheXpertPlus(Dataset):
    def __init__(self, root, split, tok, img, max_len):
        with open(os.path.join(root, f"{split}.json")) as f:
            self.items = json.load(f)
        self.root, self.tok, self.max_len = root, tok, max_len
        if split == "train":
            self.tf = transforms.Compose([transforms.RandomResizedCrop(img, scale=(0.8, 1.0), ratio=(0.9, 1.1)),
                                          transforms.ToTensor(), transforms.Normalize([0.5] * 3, [0.5] * 3)])
        else:
            self.tf = transforms.Compose([transforms.Resize(img), transforms.CenterCrop(img),
                                          transforms.ToTensor(), transforms.Normalize([0.5] * 3, [0.5] * 3)])

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        it = self.items[i]
        img = self.tf(Image.open(os.path.join(self.root, it["path_to_image"])).convert("RGB"))
        text = it["section_findings"] or it["section_impression"]
        t = self.tok(text, truncation=True, max_length=self.max_len, padding="max_length", return_tensors="pt")
        return img, t.input_ids[0], t.attention_mask[0]


class MultiScaleReporter(nn.Module):
    def __init__(self, vocab, pad_id, d=512, layers=4, max_len=128):
        super().__init__()
        self.backbone = timm.create_model("convnext_tiny.fb_in22k", pretrained=True, features_only=True,
                                          out_indices=(2, 3))
        chs = self.backbone.feature_info.channels()
        self.proj = nn.ModuleList([nn.Linear(c, d) for c in chs])
        self.level_emb = nn.Parameter(torch.zeros(len(chs), d))
        self.embed = nn.Embedding(vocab, d, padding_idx=pad_id)
        self.pos = nn.Parameter(torch.zeros(max_len, d))
        self.dec = nn.TransformerDecoder(nn.TransformerDecoderLayer(d, 8, 4 * d, 0.1, batch_first=True,
                                                                    norm_first=True), layers)
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)
        nn.init.normal_(self.pos, std=0.01)

    def memory(self, x):
        feats = self.backbone(x)
        toks = [p(f.flatten(2).transpose(1, 2)) + e for p, f, e in zip(self.proj, feats, self.level_emb)]
        return torch.cat(toks, 1)

    def forward(self, x, ids, pad_mask):
        mem = self.memory(x)
        L = ids.size(1)
        h = self.embed(ids) + self.pos[:L]
        causal = torch.triu(torch.ones(L, L, dtype=torch.bool, device=ids.device), 1)
        h = self.dec(h, mem, tgt_mask=causal, tgt_key_padding_mask=pad_mask)
        return self.head(self.ln(h))


def cosine_lambda(total, warm):
    def f(step):
        if step < warm:
            return step / max(1, warm)
        return 0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, total - warm)))
    return f


@torch.no_grad()
def evaluate(model, loader, device, pad_id):
    model.eval()
    s = torch.zeros(2, device=device, dtype=torch.float64)
    for x, ids, am in loader:
        x, ids, am = x.to(device), ids.to(device), am.to(device)
        with autocast():
            logits = model(x, ids[:, :-1], am[:, :-1] == 0)
        tgt = ids[:, 1:].masked_fill(am[:, 1:] == 0, -100)
        s[0] += F.cross_entropy(logits.float().flatten(0, 1), tgt.flatten(), ignore_index=-100,
                                reduction="sum").double()
        s[1] += (tgt != -100).sum()
    dist.all_reduce(s)
    model.train()
    return (s[0] / s[1]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    if rank != 0:
        logger.setLevel(logging.WARNING)

    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    train_ds = CheXpertPlus(args.data, "train", tok, args.img, args.max_len)
    val_ds = CheXpertPlus(args.data, "valid", tok, args.img, args.max_len)
    val_ds.items = val_ds.items[rank::world]
    sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True, seed=3)
    train_dl = DataLoader(train_ds, batch_size=args.bs, sampler=sampler, num_workers=8,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(val_ds, batch_size=args.bs, shuffle=False, num_workers=4, pin_memory=True)

    model = MultiScaleReporter(len(tok), tok.pad_token_id, max_len=args.max_len).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "pos" not in n]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2 or "pos" in n]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.wd},
                             {"params": no_decay, "weight_decay": 0.0}], lr=args.lr)
    total = args.epochs * len(train_dl)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, cosine_lambda(total, int(args.warmup * total)))
    scaler = GradScaler(init_scale=2.0 ** 12)

    if rank == 0:
        os.makedirs(args.save, exist_ok=True)
    best = float("inf")
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        seen = 0
        for step, (x, ids, am) in enumerate(train_dl):
            x, ids, am = x.to(device, non_blocking=True), ids.to(device), am.to(device)
            with autocast():
                logits = model(x, ids[:, :-1], am[:, :-1] == 0)
                tgt = ids[:, 1:].masked_fill(am[:, 1:] == 0, -100)
                loss = F.cross_entropy(logits.float().flatten(0, 1), tgt.flatten(), ignore_index=-100)
            if not torch.isfinite(loss):
                logger.warning("rank %d: non-finite loss at epoch %d step %d, skipping batch", rank, epoch, step)
                opt.zero_grad(set_to_none=True)
                continue
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            sched.step()
            seen += x.size(0)
            if step % 100 == 0:
                logger.info("epoch %d step %d/%d loss %.4f scale %.0f lr %.2e", epoch, step, len(train_dl),
                            loss.item(), scaler.get_scale(), sched.get_last_lr()[0])

        val = evaluate(model, val_dl, device, tok.pad_token_id)
        logger.info("epoch %d: val nll %.4f (ppl %.2f), %d images/rank", epoch, val, math.exp(val), seen)
        if rank == 0:
            ck = {"model": model.module.state_dict(), "opt": opt.state_dict(), "scaler": scaler.state_dict(),
                  "sched": sched.state_dict(), "epoch": epoch, "val": val}
            torch.save(ck, os.path.join(args.save, "last.pt"))
            if val < best:
                best = val
                torch.save(ck, os.path.join(args.save, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
