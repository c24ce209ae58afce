"""Swin-B encoder + GPT-2 (cross-attention) captioner, COCO Karpathy split.

Long run on a preemptible queue, so it checkpoints every --save_every steps and
resumes from --resume.

torchrun --nproc_per_node=8 11_swin_gpt2_caption_resume.py --resume runs/swin_gpt2/last.pt
"""
import argparse
import json
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms

import timm
from transformers import GPT2Config, GPT2LMHeadModel, GPT2TokenizerFast
from pycocoevalcap.cider.cider import Cider
from pycocoevalcap.bleu.bleu import Bleu
from pycocoevalcap.tokenizer.ptbtokenizer import PTBTokenizer


def get_parser():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/datasets/coco/dataset_coco.json")
    p.add_argument("--images", default="/datasets/coco")
    p.add_argument("--run_dir", default="runs/swin_gpt2")
    p.add_argument("--resume", default="")
    p.add_argument("--swin", default="swin_base_patch4_window7_224.ms_in22k")
    p.add_argument("--gpt2", default="gpt2-medium")
    p.add_argument("--global_batch", type=int, default=256)
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--lr", type=float, default=1.5e-4)
    p.add_argument("--warmup", type=int, default=2000)
    p.add_argument("--save_every", type=int, default=2000)
    p.add_argument("--beam", type=int, default=3)
    p.add_argument("--max_len", type=int, default=32)
    return p


class Coco(Dataset):
    def __init__(self, path, root, split, tf, tok=None, max_len=32):
        ims = [im for im in json.load(open(path))["images"]
               if im["split"] in ({"train", "restval"} if split == "train" else {split})]
        self.train, self.root, self.tf, self.tok, self.max_len = split == "train", root, tf, tok, max_len
        self.items = [(im, s["raw"]) for im in ims for s in im["sentences"]] if self.train else [(im, None) for im in ims]
        self.refs = {im["cocoid"]: [s["raw"] for s in im["sentences"]] for im in ims}

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        im, cap = self.items[i]
        x = self.tf(Image.open(os.path.join(self.root, im["filepath"], im["filename"])).convert("RGB"))
        if not self.train:
            return x, im["cocoid"]
        ids = self.tok(self.tok.bos_token + cap.strip() + self.tok.eos_token, truncation=True,
                       max_length=self.max_len).input_ids
        ids = ids + [self.tok.eos_token_id] * (self.max_len - len(ids))
        n = min(len(self.tok(cap.strip()).input_ids) + 2, self.max_len)
        return x, torch.tensor(ids), torch.tensor(n)


class SwinGPT2(nn.Module):
    def __init__(self, swin, gpt2):
        super().__init__()
        self.enc = timm.create_model(swin, pretrained=True, num_classes=0)
        cfg = GPT2Config.from_pretrained(gpt2, add_cross_attention=True)
        self.dec = GPT2LMHeadModel.from_pretrained(gpt2, config=cfg)
        self.bridge = nn.Linear(self.enc.num_features, cfg.n_embd)

    def encode(self, x):
        f = self.enc.forward_features(x)  # B, H, W, C
        return self.bridge(f.flatten(1, 2))

    def forward(self, x, ids, attn):
        return self.dec(input_ids=ids, attention_mask=attn, encoder_hidden_states=self.encode(x)).logits

    @torch.no_grad()
    def beam_search(self, x, bos, eos, beam, max_len):
        mem = self.encode(x)
        B = mem.size(0)
        mem = mem.repeat_interleave(beam, 0)
        seqs = torch.full((B * beam, 1), bos, dtype=torch.long, device=x.device)
        scores = torch.zeros(B, beam, device=x.device)
        scores[:, 1:] = -1e9
        finished = torch.zeros(B * beam, dtype=torch.bool, device=x.device)
        for _ in range(max_len - 1):
            logp = self.dec(input_ids=seqs, encoder_hidden_states=mem).logits[:, -1].float().log_softmax(-1)
            logp[finished] = -1e9
            logp[finished, eos] = 0.0
            V = logp.size(-1)
            cand = (scores.view(-1, 1) + logp).view(B, beam * V)
            scores, idx = cand.topk(beam, dim=1)
            src = (idx // V) + torch.arange(B, device=x.device)[:, None] * beam
            seqs = torch.cat([seqs[src.view(-1)], (idx % V).view(-1, 1)], 1)
            finished = finished[src.view(-1)] | (seqs[:, -1] == eos)
            if finished.all():
                break
        lengths = ((seqs != eos).sum(1) - 1).clamp(min=1).view(B, beam).float()
        best = (scores / lengths ** 0.6).argmax(1)
        return seqs.view(B, beam, -1)[torch.arange(B), best]


def cosine_lr(step, total, warmup, base):
    if step < warmup:
        return base * step / warmup
    return 0.5 * base * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


def main():
    args = get_parser().parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    tok = GPT2TokenizerFast.from_pretrained(args.gpt2)
    norm = transforms.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
    train_set = Coco(args.data, args.images, "train", transforms.Compose([
        transforms.RandomResizedCrop(224, scale=(0.6, 1)), transforms.ToTensor(), norm]), tok, args.max_len)
    val_set = Coco(args.data, args.images, "val", transforms.Compose([
        transforms.Resize((224, 224)), transforms.ToTensor(), norm]))
    sampler = DistributedSampler(train_set, shuffle=True, seed=17)
    loader = DataLoader(train_set, batch_size=args.global_batch // world, sampler=sampler,
                        num_workers=8, pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(val_set, batch_size=32, sampler=DistributedSampler(val_set, shuffle=False),
                            num_workers=8)

    model = DDP(SwinGPT2(args.swin, args.gpt2).to(device), device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    scaler = torch.cuda.amp.GradScaler()
    steps_per_epoch = len(loader)
    total = steps_per_epoch * args.epochs

    start_epoch, step, best = 0, 0, 0.0
    if args.resume and os.path.isfile(args.resume):
        ckpt = torch.load(args.resume)
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch, step, best = ckpt["epoch"], ckpt["step"], ckpt.get("best_cider", 0.0)
        if rank == 0:
            print(f"resumed from {args.resume} at epoch {start_epoch} step {step}", flush=True)

    def save(path, epoch):
        if rank == 0:
            tmp = path + ".tmp"
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scaler": scaler.state_dict(), "epoch": epoch, "step": step, "best_cider": best}, tmp)
            os.replace(tmp, path)

    os.makedirs(args.run_dir, exist_ok=True)
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        skip = step - epoch * steps_per_epoch  # batches already done in this epoch before preemption
        for i, (x, ids, n) in enumerate(loader):
            if i < skip:
                continue
            x, ids, n = x.to(device, non_blocking=True), ids.to(device, non_blocking=True), n.to(device)
            attn = (torch.arange(ids.size(1), device=device)[None] < n[:, None]).long()
            for g in optimizer.param_groups:
                g["lr"] = cosine_lr(step, total, args.warmup, args.lr)
            with torch.autocast("cuda", dtype=torch.float16):
                logits = model(x, ids, attn)
            labels = ids[:, 1:].masked_fill(attn[:, 1:] == 0, -100)
            loss = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.size(-1)), labels.reshape(-1),
                                   ignore_index=-100)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            step += 1
            if step % 100 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"[{epoch}] step {step}/{total} loss {l.item():.4f}", flush=True)
            if step % args.save_every == 0:
                save(os.path.join(args.run_dir, "last.pt"), epoch)

        model.eval()
        local = []
        for x, iids in val_loader:
            with torch.autocast("cuda", dtype=torch.float16):
                out = model.module.beam_search(x.to(device), tok.bos_token_id, tok.eos_token_id, args.beam, args.max_len)
            local += [(i, tok.decode(s[1:], skip_special_tokens=True).strip()) for i, s in zip(iids.tolist(), out.tolist())]
        allp = [None] * world
        dist.all_gather_object(allp, local)
        if rank == 0:
            preds = dict(p for part in allp for p in part)
            ptb = PTBTokenizer()
            gts = ptb.tokenize({k: [{"caption": c} for c in val_set.refs[k]] for k in preds})
            res = ptb.tokenize({k: [{"caption": v}] for k, v in preds.items()})
            cider = Cider().compute_score(gts, res)[0]
            bleu4 = Bleu(4).compute_score(gts, res)[0][3]
            print(f"epoch {epoch}: CIDEr {cider:.4f} BLEU-4 {bleu4:.4f}", flush=True)
            if cider > best:
                best = cider
                torch.save(model.module.state_dict(), os.path.join(args.run_dir, "best_model.pt"))
        save(os.path.join(args.run_dir, "last.pt"), epoch + 1)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
