#!/usr/bin/env python
# Prefix-LM report generation: Swin-B visual tokens are mapped into BioGPT's
# embedding space and prepended to the report tokens.
#
#   torchrun --nnodes=1 --nproc_per_node=8 05_swin_biogpt_prefix.py \
#       --train-jsonl data/mimic/train.jsonl --val-jsonl data/mimic/val.jsonl \
#       --resume runs/swin_biogpt/step_20000.pt
import argparse
import json
import math
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
from torchvision import transforms
from transformers import BioGptForCausalLM, BioGptTokenizer


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train-jsonl", required=True)
    ap.add_argument("--val-jsonl", required=True)
    ap.add_argument("--image-root", default="/datasets/mimic-cxr-jpg/2.0.0")
    ap.add_argument("--run-dir", default="runs/swin_biogpt")
    ap.add_argument("--init-encoder", default="", help="CheXpert-finetuned Swin weights")
    ap.add_argument("--resume", default="")
    ap.add_argument("--prefix-len", type=int, default=32)
    ap.add_argument("--max-text", type=int, default=150)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--max-steps", type=int, default=60000)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--warmup", type=int, default=2000)
    ap.add_argument("--eval-every", type=int, default=2000)
    return ap.parse_args()


class JsonlReports(Dataset):
    def __init__(self, path, root, train):
        with open(path) as f:
            self.rows = [json.loads(line) for line in f]
        self.root = root
        self.tf = transforms.Compose([
            transforms.Resize((384, 384)),
            *([transforms.ColorJitter(0.2, 0.2)] if train else []),
            transforms.ToTensor(),
            transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]),
        ])

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        return self.tf(Image.open(os.path.join(self.root, r["image"])).convert("RGB")), r["report"]


class Collate:
    def __init__(self, tok, max_text):
        self.tok, self.max_text = tok, max_text

    def __call__(self, batch):
        imgs, texts = zip(*batch)
        enc = self.tok(list(texts), max_length=self.max_text, truncation=True,
                       padding="longest", return_tensors="pt")
        return torch.stack(imgs), enc.input_ids, enc.attention_mask


class PrefixReporter(nn.Module):
    def __init__(self, prefix_len):
        super().__init__()
        self.visual = timm.create_model("swin_base_patch4_window12_384", pretrained=True, num_classes=0)
        self.lm = BioGptForCausalLM.from_pretrained("microsoft/biogpt")
        d = self.lm.config.hidden_size
        self.prefix_len = prefix_len
        self.queries = nn.Parameter(torch.randn(prefix_len, d) * 0.02)
        self.kv = nn.Linear(self.visual.num_features, d)
        self.xattn = nn.MultiheadAttention(d, 16, batch_first=True)
        self.ln = nn.LayerNorm(d)

    def prefix(self, images):
        f = self.kv(self.visual.forward_features(images).flatten(1, 2))
        q = self.queries.unsqueeze(0).expand(f.size(0), -1, -1)
        return self.ln(self.xattn(q, f, f, need_weights=False)[0] + q)

    def forward(self, images, ids, mask):
        pre = self.prefix(images)
        emb = self.lm.get_input_embeddings()(ids)
        inputs = torch.cat([pre, emb], 1)
        full_mask = torch.cat([mask.new_ones(mask.size(0), self.prefix_len), mask], 1)
        return self.lm(inputs_embeds=inputs, attention_mask=full_mask).logits[:, self.prefix_len:]

    @torch.no_grad()
    def greedy(self, images, bos, eos, max_len):
        pre = self.prefix(images)
        ids = torch.full((images.size(0), 1), bos, dtype=torch.long, device=images.device)
        for _ in range(max_len):
            emb = self.lm.get_input_embeddings()(ids)
            logits = self.lm(inputs_embeds=torch.cat([pre, emb], 1)).logits[:, -1]
            nxt = logits.argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], 1)
            if (ids == eos).any(1).all():
                break
        return ids


def lr_at(step, args):
    if step < args.warmup:
        return args.lr * step / args.warmup
    prog = (step - args.warmup) / max(1, args.max_steps - args.warmup)
    return args.lr * 0.5 * (1 + math.cos(math.pi * prog))


def text_loss(logits, ids, mask):
    tgt = ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
    return F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.size(-1)), tgt.reshape(-1),
                           ignore_index=-100, reduction="sum"), (tgt != -100).sum()


@torch.no_grad()
def evaluate(model, loader, tok, device, rank, max_text):
    model.eval()
    acc = torch.zeros(2, device=device)
    example = None
    for images, ids, mask in loader:
        images, ids, mask = images.to(device), ids.to(device), mask.to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model.module(images, ids, mask)
        s, n = text_loss(logits, ids, mask)
        acc += torch.stack([s, n.float()])
        if example is None and rank == 0:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = model.module.greedy(images[:2], tok.bos_token_id, tok.eos_token_id, max_text)
            example = tok.batch_decode(out, skip_special_tokens=True)
    dist.all_reduce(acc)
    model.train()
    return (acc[0] / acc[1]).item(), example


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    tok = BioGptTokenizer.from_pretrained("microsoft/biogpt")
    collate = Collate(tok, args.max_text)
    train_ds = JsonlReports(args.train_jsonl, args.image_root, True)
    val_ds = JsonlReports(args.val_jsonl, args.image_root, False)
    val_ds.rows = val_ds.rows[rank::world]
    sampler = DistributedSampler(train_ds, shuffle=True, seed=0, drop_last=True)
    train_dl = DataLoader(train_ds, args.batch_size, sampler=sampler, collate_fn=collate,
                          num_workers=8, pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(val_ds, args.batch_size, shuffle=False, collate_fn=collate,
                        num_workers=4, pin_memory=True)

    model = PrefixReporter(args.prefix_len)
    if args.init_encoder:
        enc_sd = torch.load(args.init_encoder, map_location="cpu")
        missing, unexpected = model.visual.load_state_dict(enc_sd, strict=False)
        if rank == 0:
            print(f"encoder init: missing={len(missing)} unexpected={len(unexpected)}")
    model = DDP(model.to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.05)

    step = 0
    if args.resume:
        ckpt = torch.load(args.resume)
        model.module.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optim"])
        step = ckpt["step"]
        if rank == 0:
            print(f"resumed from {args.resume} at step {step}")
        del ckpt

    os.makedirs(args.run_dir, exist_ok=True)
    steps_per_epoch = len(train_dl)
    epoch = step // steps_per_epoch
    skip = step % steps_per_epoch
    t0 = time.time()
    while step < args.max_steps:
        sampler.set_epoch(epoch)
        for i, (images, ids, mask) in enumerate(train_dl):
            if i < skip:
                continue
            images = images.to(device, non_blocking=True)
            ids, mask = ids.to(device, non_blocking=True), mask.to(device, non_blocking=True)
            for g in opt.param_groups:
                g["lr"] = lr_at(step, args)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(images, ids, mask)
            s, n = text_loss(logits, ids, mask)
            loss = s / n.clamp(min=1)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gnorm = nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            step += 1

            if rank == 0 and step % 50 == 0:
                print(f"step {step} loss {loss.item():.4f} gnorm {gnorm:.2f} "
                      f"lr {lr_at(step, args):.2e} {(time.time() - t0) / 50:.2f}s/it", flush=True)
                t0 = time.time()
            if step % args.eval_every == 0:
                val_loss, example = evaluate(model, val_dl, tok, device, rank, args.max_text)
                if rank == 0:
                    print(f"[eval] step {step} val_loss {val_loss:.4f} ppl {math.exp(val_loss):.2f}")
                    print("  sample:", example[0] if example else "")
                    torch.save({"model": model.module.state_dict(), "optim": opt.state_dict(),
                                "step": step, "args": vars(args)},
                               os.path.join(args.run_dir, f"step_{step}.pt"))
                dist.barrier()
            if step >= args.max_steps:
                break
        skip = 0
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
